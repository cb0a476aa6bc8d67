"""The /v1/responses route: its body and input items, the answer's events and output items, the stored responses."""
