"""Meshes (mesh.py) and runs of more than one process (distributed.py)."""
