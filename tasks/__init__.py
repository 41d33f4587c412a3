"""Stage kinds, the artifact store and process launching: the only layer that knows both the
engine and the store. Three subpackages, one concern each: stages/ (one module per built-in
stage kind), store/ (ids, digests, manifests, locks; a local and a bucket store behind one
interface), launch/ (a stage's processes). Beside them: registry.py (stage kinds by name),
runner.py (skip / resume / lock protocol of one stage), plan.py (`trainflow plan`),
engine_stage.py (the base of kinds that run the engine) and artifacts.py (the store's record
names where the rest of trainflow imports them)."""
