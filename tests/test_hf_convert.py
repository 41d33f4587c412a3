"""Conversion mechanics: restore on other meshes, bfloat16, sharded inputs, the CLI, export
into a folder that holds a model (refused, or replaced with --overwrite), safetensors files
read and written in the package's format, and bad input (unsupported architecture, missing /
mis-shaped tensors, config-weights mismatch, a corrupt file) rejected with a message naming
the architecture, tensor or file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from safetensors import safe_open  # noqa: E402

from engine.config import ConfigError, preset_names, resolve_model_preset  # noqa: E402
from engine.interop.hf.__main__ import main  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_to_hf  # noqa: E402
from engine.interop.hf.safetensors_io import SafetensorsFile, write_safetensors  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.params import abstract_model_params, apply_model, graphdef_of  # noqa: E402
from engine.parallel.config import MeshConfig  # noqa: E402
from engine.parallel.mesh import make_mesh  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402

# Sizes that divide fsdp=8 and tensor=4, so the restore is really sharded.
DIVISIBLE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
)


def random_llama(seed: int, out: Path) -> Path:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DIVISIBLE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return random_llama(0, tmp_path_factory.mktemp("llama") / "hf")


@pytest.fixture(scope="module")
def converted(llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted")
    convert_hf(llama_dir, out)
    return out / "checkpoint"


@pytest.mark.parametrize(
    "mesh",
    [
        {"data": 1, "fsdp": 8, "tensor": 1},
        {"data": 2, "fsdp": 1, "tensor": 4},
        {"data": 1, "fsdp": 2, "context": 2, "tensor": 2},
    ],
)
def test_a_converted_checkpoint_restores_onto_any_mesh(converted, mesh):
    cfg, reference, _ = load_params(converted)
    _, compute = stored_configs(converted)
    device_mesh = make_mesh(MeshConfig(**mesh))
    _, params, _ = load_params(converted, abstract_model_params(cfg, compute, device_mesh))
    wq = params["blocks"]["attn"]["wq_dnh"]  # (layers, embed, heads, head_dim)
    context = mesh.get("context", 1)  # the parameters split over it as over fsdp
    assert wq.sharding.spec == P(None, "fsdp" if context == 1 else ("fsdp", "context"), "tensor", None)
    assert wq.addressable_shards[0].data.shape == (2, 32 // (mesh["fsdp"] * context), 8 // mesh["tensor"], 8)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    graphdef = graphdef_of(cfg, compute)
    np.testing.assert_allclose(
        np.asarray(apply_model(graphdef, params, tokens)),
        np.asarray(apply_model(graphdef, reference, tokens)),
        atol=1e-5,
    )


def test_bfloat16_conversion_rounds_once_and_round_trips_bitwise(llama_dir, converted, tmp_path):
    convert_hf(llama_dir, tmp_path / "bf16", dtype="bfloat16")
    _, params, _ = load_params(tmp_path / "bf16" / "checkpoint")
    _, compute = stored_configs(tmp_path / "bf16" / "checkpoint")
    assert compute.param_dtype == "bfloat16" and compute.dtype == "bfloat16"
    _, f32, _ = load_params(converted)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(f32)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16))
    # A small shard limit: several shards and an index, read back through the index.
    result = export_hf(tmp_path / "bf16" / "checkpoint", tmp_path / "export", max_shard_bytes=20_000)
    assert result["shards"] > 2
    with SafetensorsFile(tmp_path / "export" / "model-00001-of-{:05d}.safetensors".format(result["shards"])) as st:
        assert {str(st.dtype(n)) for n in st.names()} == {"bfloat16"}
    convert_hf(tmp_path / "export", tmp_path / "again")  # dtype None keeps bfloat16
    _, again, _ = load_params(tmp_path / "again" / "checkpoint")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert reloaded.dtype == torch.bfloat16


def test_a_bfloat16_checkpoint_with_a_few_float32_tensors_converts_as_bfloat16(llama_dir, tmp_path):
    """transformers keeps some modules in float32 in a bf16 model (DeepSeek-V3's router weight
    and score bias): the source's dtype is the one most of its bytes have, not float32 because
    any tensor is."""
    shutil.copytree(llama_dir, tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    with SafetensorsFile(path) as st:
        tensors = [
            (n, st.get(n) if n == "model.norm.weight" else st.get(n).astype(ml_dtypes.bfloat16)) for n in st.names()
        ]
    write_safetensors(path, tensors)
    convert_hf(tmp_path / "hf", tmp_path / "out")
    _, compute = stored_configs(tmp_path / "out" / "checkpoint")
    _, params, _ = load_params(tmp_path / "out" / "checkpoint")
    assert compute.param_dtype == "bfloat16"
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params)} == {"bfloat16"}


def test_cli_convert_and_export(llama_dir, tmp_path, capsys):
    assert main(["convert", str(llama_dir), str(tmp_path / "c")]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert result["architecture"] == "LlamaForCausalLM" and "model.safetensors" in result["source"]["files"]
    assert main(["export", str(tmp_path / "c" / "checkpoint"), str(tmp_path / "e")]) == 0
    assert (tmp_path / "e" / "config.json").is_file()
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err


# --------------------------------------------------------------------------- an occupied target


def files_of(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_export_into_a_folder_with_a_model_is_refused_unless_overwrite_which_loads_the_new_one(
    converted, tmp_path, capsys
):
    """The reported case: DIR holds model.safetensors (model A); exporting model B there as
    shards must not leave A beside them, or transformers loads A."""
    other = tmp_path / "b"
    convert_hf(random_llama(1, tmp_path / "hf_b"), other)
    target = tmp_path / "target"
    assert main(["export", str(converted), str(target)]) == 0
    (target / "pytorch_model.bin").write_bytes(b"an older model")  # stale too
    before = files_of(target)
    capsys.readouterr()

    assert main(["export", str(other / "checkpoint"), str(target), "--max-shard-gb", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {target} is not empty") and "--overwrite" in err and err.count("\n") == 1
    assert files_of(target) == before  # nothing written

    assert main(["export", str(other / "checkpoint"), str(target), "--max-shard-gb", "1e-5", "--overwrite"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])["result"]
    assert set(result["removed_weights"]) == {"model.safetensors", "pytorch_model.bin"}
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in target.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert not (target / "pytorch_model.bin").exists() and result["shards"] > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(target)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_b")
    for (name, a), (_, b) in zip(loaded.state_dict().items(), reference.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_export_hf_refuses_a_non_empty_directory_naming_it(converted, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=rf"^{tmp_path} is not empty; .* pass --overwrite"):
        export_hf(converted, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    export_hf(converted, tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only weights are removed
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "model.safetensors.index.json").exists()


# --------------------------------------------------------------------------- safetensors files


def test_safetensors_written_here_read_back_by_the_package_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((5, 3), np.float32).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((7,), np.float32),
        "h": np.arange(11, dtype=np.float16),
    }
    shapes = {name: (a.shape, a.dtype) for name, a in tensors.items()}
    write_safetensors(tmp_path / "x.safetensors", iter(tensors.items()), {"format": "pt"}, shapes=shapes)
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:  # torch's reader, bfloat16 included
        assert f.metadata() == {"format": "pt"} and list(f.offset_keys()) == ["w", "b", "h"]
        w = f.get_tensor("w")
        assert w.dtype == torch.bfloat16
        np.testing.assert_array_equal(w.view(torch.int16).numpy(), tensors["w"].view(np.int16))
    with SafetensorsFile(tmp_path / "x.safetensors") as st:
        assert st.names() == ["w", "b", "h"] and st.shape("w") == (5, 3) and st.dtype("w") == tensors["w"].dtype
        for name, array in tensors.items():
            assert st.get(name).dtype == array.dtype
            np.testing.assert_array_equal(st.get(name).view(np.uint8), array.view(np.uint8))


def test_a_corrupt_safetensors_file_is_named(llama_dir, tmp_path):
    hf_dir = edited_copy(llama_dir, tmp_path / "m")
    data = (hf_dir / "model.safetensors").read_bytes()
    (hf_dir / "model.safetensors").write_bytes(data[: len(data) // 2])  # cut short
    message = convert_error(hf_dir, tmp_path)
    assert f"{hf_dir / 'model.safetensors'}: not a readable safetensors file" in message


# --------------------------------------------------------------------------- bad input


def edited_copy(src: Path, dst: Path, config_edit=None, drop: str | None = None, replace: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    if drop or replace:
        path = dst / "model.safetensors"
        with SafetensorsFile(path) as st:
            tensors = {n: np.array(st.get(n)) for n in st.names() if n != drop}
        tensors.update(replace or {})
        write_safetensors(path, list(tensors.items()), metadata={"format": "pt"})
    return dst


def convert_error(hf_dir: Path, tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        convert_hf(hf_dir, tmp_path / "out")
    return str(err.value)


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    def to_t5(c):
        c.update(model_type="t5", architectures=["T5ForConditionalGeneration"])

    message = convert_error(edited_copy(llama_dir, tmp_path / "m", to_t5), tmp_path)
    assert "unsupported architecture 'T5ForConditionalGeneration'" in message and "LlamaForCausalLM" in message


def test_unsupported_rope_type_is_named(llama_dir, tmp_path):
    def longrope(c):  # Phi-3's (its family reads it), not Llama's
        c.pop("rope_parameters", None)
        c["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}

    assert "RoPE type 'longrope'" in convert_error(edited_copy(llama_dir, tmp_path / "m", longrope), tmp_path)


def test_a_missing_tensor_is_named(llama_dir, tmp_path):
    hf_dir = edited_copy(llama_dir, tmp_path / "m", drop="model.layers.1.mlp.up_proj.weight")
    message = convert_error(hf_dir, tmp_path)
    assert "'model.layers.1.mlp.up_proj.weight'" in message and "missing" in message


def test_a_mis_shaped_tensor_is_named(llama_dir, tmp_path):
    bad = {"model.layers.0.self_attn.k_proj.weight": np.zeros((24, 32), np.float32)}
    message = convert_error(edited_copy(llama_dir, tmp_path / "m", replace=bad), tmp_path)
    assert "'model.layers.0.self_attn.k_proj.weight' has shape [24, 32]" in message and "[32, 32]" in message


def test_config_and_weights_that_disagree_are_named(llama_dir, tmp_path):
    def fewer_layers(c):
        c["num_hidden_layers"] = 1

    message = convert_error(edited_copy(llama_dir, tmp_path / "a", fewer_layers), tmp_path)
    assert "unexpected tensor 'model.layers.1." in message and "LlamaForCausalLM" in message

    def tied(c):
        c["tie_word_embeddings"] = True  # but lm_head.weight is its own matrix

    message = convert_error(edited_copy(llama_dir, tmp_path / "b", tied), tmp_path)
    assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in message


def test_export_refuses_a_config_its_family_cannot_express(converted):
    cfg, _, _ = load_params(converted)
    with pytest.raises(ConfigError, match=r"model.qk_norm=True cannot be expressed as a Hugging Face LlamaForCausalLM"):
        model_config_to_hf(cfg.model_copy(update={"qk_norm": True}))


# --------------------------------------------------------------------------- presets

PUBLISHED_BILLIONS = {  # parameter counts of the released models
    "llama2-7b": 6.74,
    "llama3.1-8b": 8.03,
    "llama3.2-3b": 3.21,
    "mistral-7b": 7.24,
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-7b": 7.62,
    "qwen3-0.6b": 0.60,
    "qwen3-8b": 8.19,
    "gemma-2b": 2.51,
    "gemma2-2b": 2.61,
    "gemma3-1b": 1.00,
    "mixtral-8x7b": 46.70,
    "qwen3-30b-a3b": 30.53,
    "gpt-oss-20b": 20.91,
    "gpt-oss-120b": 116.83,
    "deepseek-v3": 671.03,  # the causal LM without its multi-token-prediction layer (685B with it)
    "deepseek-v4-flash": 284.33,  # DeepSeek-V4-Flash, "284B", without its multi-token-prediction module
    "smollm3-3b": 3.08,
    "olmo2-7b": 7.30,
    "phi3-mini-4k": 3.82,
    "phi3.5-mini": 3.82,  # microsoft/Phi-3.5-mini-instruct (LongRoPE)
    "phi4-mini": 3.84,  # microsoft/Phi-4-mini-instruct: 3,836,021,760
    # Llama 4's text decoders (Llama4ForCausalLM); the published 109B / 400B count the
    # multimodal checkpoints, vision tower included
    "llama4-scout": 107.77,
    "llama4-maverick": 400.71,
    "gemma4-31b": 30.70,  # the text decoder of google/gemma-4-31B (its vision tower apart)
    "nemotron-h-8b": 8.10,  # nvidia/Nemotron-H-8B-Base-8K
    "nemotron-h-56b": 56.32,  # nvidia/Nemotron-H-56B-Base-8K
    "nemotron-h-47b": 46.79,  # nvidia/Nemotron-H-47B-Base-8K: "47B"
    "nemotron-3-nano-30b-a3b": 31.58,  # NVIDIA-Nemotron-3-Nano-30B-A3B: "31.6B total"
    "granite-4.0-h-small": 32.21,  # docker/model-cards ai/granite-4.0-h-small.md: 32.21 B
    "granite-4.0-h-micro": 3.19,  # docker/model-cards ai/granite-4.0-h-micro.md: 3.2B
    # Qwen3-Next without its multi-token-prediction layer; Qwen3.5's text decoders (their
    # published counts include the vision tower and the MTP layer)
    "qwen3-next-80b-a3b": 79.67,
    "qwen3.5-27b": 26.90,
    "qwen3.5-35b-a3b": 34.66,
    "qwen3.5-122b-a10b": 122.11,
    "qwen3.5-397b-a17b": 396.35,
}


def test_every_model_preset_is_the_transformers_model_with_the_same_parameters():
    for name in preset_names():
        cfg = ModelConfig.model_validate(resolve_model_preset({"model": name}, name)["model"])
        hf_config = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
        with torch.device("meta"):  # shapes only, no memory
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
        # Gemma 4's layer_scalar is a buffer in transformers, a parameter here (as MaxText's);
        # the routers' choosing bias a buffer (DeepSeek-V3) or a frozen parameter (ERNIE 4.5's
        # moe_statics, AFMoE's expert_bias), counted by neither
        scalars = sum(b.numel() for key, b in model.named_buffers() if key.endswith("layer_scalar"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trainable + scalars == cfg.num_params(), name
        if name in PUBLISHED_BILLIONS:
            assert round(cfg.num_params() / 1e9, 2) == PUBLISHED_BILLIONS[name], name
