"""The built-in stage kinds: the module tasks/stages/<task>.py defines the kind `task` (and
nothing else lives here: tasks/registry.py lists the kinds from these modules' names)."""
