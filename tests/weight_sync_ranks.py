"""One rank of tests/test_weight_sync.py's trainer of 2 processes.

    python -m tests.weight_sync_ranks URL OUT SHARD_BYTES      (under the local-multi launcher)

The test's model initialised with fsdp spanning the processes, pushed to URL; then its final
norm changed and pushed again. Each rank writes OUT/rank<i>.json (the two pushes' numbers);
rank 0 also OUT/params.npz, the second version's leaves as the trainer holds them (gathered).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from engine.interop.weight_sync import BucketWeightSync
from engine.models.config import ComputeConfig
from engine.models.params import init_params
from engine.parallel.config import MeshConfig
from engine.parallel.distributed import maybe_initialize_distributed
from engine.parallel.mesh import make_mesh, to_host
from tests.test_weight_sync import CFG


def main(argv: list[str]) -> int:
    url, out, shard_bytes = argv[0], Path(argv[1]), int(argv[2])
    maybe_initialize_distributed()
    assert jax.process_count() == 2, jax.process_count()
    mesh = make_mesh(MeshConfig(data=1, fsdp=2))
    params = init_params(CFG, ComputeConfig(), mesh, seed=3)
    assert not params["embed_vd"].is_fully_addressable  # the gather is exercised
    sync = BucketWeightSync(url, CFG, ComputeConfig(), shard_bytes=shard_bytes)
    sync.push(params)
    first = sync.last
    params["final_norm"]["scale"] = params["final_norm"]["scale"] + 0.5
    sync.push(params)
    numbers = {
        name: {k: v for k, v in stats.items() if k != "stage_seconds"}
        for name, stats in [("first", first), ("second", sync.last)]
    }
    (out / f"rank{jax.process_index()}.json").write_text(json.dumps(numbers))
    host = [to_host(x) for x in jax.tree.leaves(params)]
    if jax.process_index() == 0:
        np.savez(out / "params.npz", **{str(i): x for i, x in enumerate(host)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
