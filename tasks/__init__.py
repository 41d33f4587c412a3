"""Stage kinds and the artifact store: the only layer that knows both the engine and the
store. registry.py (stage kinds), artifacts.py (store, ids, digests, locks), runner.py
(skip / resume / lock protocol of one stage), launch.py (child processes), and one module
per built-in stage kind."""
