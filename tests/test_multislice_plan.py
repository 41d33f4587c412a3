"""Multi-slice targets (`--target v5p-8x2`: two v5p-8 slices joined by DCN): the mesh lays
the axes `mesh.dcn` names over whole slices and the rest within each, the step compiles for
libtpu's multi-slice topology on this CPU host, and the plan reports the bytes each chip
sends over DCN (the Megascale transfers the compiler lowers cross-slice collectives to) and
over ICI, per step."""

import importlib.util

import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import make_mesh
from engine.train.config import TrainConfig
from engine.train.plan import format_plan, plan_step, summary, target_devices
from engine.train.targets import get_target
from tasks.registry import get_stage_kind

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")


def test_a_slice_name_times_n_is_n_such_slices_and_a_bad_name_is_one_sentence():
    target = get_target("v5p-256x2")
    assert (target.chips, target.slices, target.topology) == (256, 2, "v5p:4x4x8")
    assert get_target("v5p-8").slices == 1
    with pytest.raises(ConfigError, match=r"unknown target 'h100x8x2'.* or a TPU slice's name x N slices"):
        get_target("h100x8x2")


@needs_libtpu
@pytest.mark.parametrize(("dcn", "spanning"), [({}, "data"), ({"data": 2}, "data"), ({"fsdp": 2}, "fsdp")])
def test_the_axes_mesh_dcn_names_span_the_slices_and_the_others_stay_within_one(dcn, spanning):
    """Along the spanning axis the slice changes (its DCN factor major: first half slice 0);
    along every other axis the devices share a slice. Unset, `data` spans the slices."""
    devices = target_devices(get_target("v5p-8x2"))
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, dcn=dcn), devices)
    slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    for axis, name in enumerate(mesh.axis_names):
        varies = (np.diff(slice_of, axis=axis) != 0).any() if slice_of.shape[axis] > 1 else False
        assert varies == (name == spanning), name
    assert sorted(set(slice_of.flat)) == [0, 1]


@needs_libtpu
def test_a_mesh_that_cannot_span_the_slices_is_one_sentence():
    devices = target_devices(get_target("v5p-8x2"))
    with pytest.raises(ConfigError, match=r"mesh.dcn: .*spans 4 slices but the devices are 2"):
        make_mesh(MeshConfig(data=2, fsdp=4, dcn={"data": 2, "fsdp": 2}), devices)
    with pytest.raises(ConfigError, match=r"cannot span 2 slices as mesh.dcn .*multiple of its dcn factor"):
        make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2, dcn={"data": 2}), devices)
    with pytest.raises(ConfigError, match=r"mesh.dcn: .* spans slices, but the devices are one slice"):
        make_mesh(MeshConfig(data=2, fsdp=4, dcn={"data": 2}), target_devices(get_target("v5p-16")))


def _plan(target: str, dcn: dict | None):
    mesh = {"data": 2, "fsdp": 4} if dcn is None else {"data": 2, "fsdp": 4, "dcn": dcn}
    tree = {
        "model": "tiny",
        "mesh": mesh,
        "data": {"seq_len": 128, "batch_size": 8},
        "steps": 3,
        "compute": {"dtype": "bfloat16"},
    }
    return plan_step(load_config(tree=tree, schema=TrainConfig), get_target(target))


@needs_libtpu
def test_the_plan_reports_what_crosses_dcn_data_over_slices_moves_the_gradients_fsdp_more():
    """The same 8 chips and mesh (data 2 x fsdp 4) as one v5p-16 slice and as two v5p-8
    slices: one slice sends nothing over DCN; with data over the slices, only the gradient
    all-reduce crosses (each chip its gradient shard, padded to the TPU's tiles: between 1x and
    2x its size); with fsdp over them the layers' weight all-gathers cross too, more bytes."""
    one = _plan("v5p-16", None)
    data, fsdp = _plan("v5p-8x2", {"data": 2}), _plan("v5p-8x2", {"fsdp": 2})
    assert one.network["dcn"] == 0 and one.network["ici"] > 0
    gradients = data.memory.gradients
    assert gradients < data.network["dcn"] < 2 * gradients
    hlo = data.compiled.as_text()
    assert set(
        line.split('_xla_megascale_transfer_type="')[1].split('"')[0]
        for line in hlo.splitlines()
        if "_xla_megascale_transfer_type" in line
    ) == {"ALL_REDUCE"}
    assert fsdp.network["dcn"] > 2 * data.network["dcn"]
    assert data.devices == 8 and data.fits and data.memory.total < 1.2 * one.memory.total
    text = format_plan(data)
    assert "8 x TPU v5p (2 slices of topology v5p:2x2x1)" in text
    assert f"DCN {data.network['dcn'] / 2**20:.2f} MiB (sent to other slices)" in text
    assert summary(data)["network_bytes"] == data.network


def test_mesh_dcn_unset_stays_out_of_artifact_ids_and_set_enters_them():
    kind = get_stage_kind("pretrain")
    base = {"model": "tiny", "steps": 3, "data": {"seq_len": 32, "batch_size": 4}}
    plain = kind.fingerprint(kind.resolve_config(base, "t.yaml"))
    spread = kind.fingerprint(kind.resolve_config({**base, "mesh": {"dcn": {"data": 2}}}, "t.yaml"))
    assert "dcn" not in plain["mesh"] and spread["mesh"]["dcn"]["data"] == 2
