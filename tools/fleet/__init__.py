"""The fleet: `ringserve fleet` runs N replicas behind one Envoy, the Envoy config it generates, and a probe of a running fleet."""
