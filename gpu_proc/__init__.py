"""The GPU process: scheduler core, model runner, attention."""
