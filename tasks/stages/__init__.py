"""The built-in stage kinds, one module each (tasks/registry.py names them), and
engine_stage.py, the base of the kinds that run the engine in child processes."""
