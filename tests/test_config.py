import dataclasses

import pytest
import torch

from kvarn_compile import PRESETS, KVarNConfig, get_config


def test_presets_match_the_method_table():
    expected = {"k4v2": (4, 2, 128), "k4v4": (4, 4, 128), "k2v2": (2, 2, 128),
                "k4v2_g64": (4, 2, 64), "k4v4_g64": (4, 4, 64)}
    assert set(PRESETS) == set(expected) | {"k2v2_clip"}
    for name, (kb, vb, g) in expected.items():
        cfg = get_config(name)
        assert (cfg.key_bits, cfg.value_bits, cfg.group_size) == (kb, vb, g)
        assert cfg.sinkhorn_iters == 8 and cfg.method == "kvarn" and cfg.scale_dtype == "float16"
        assert cfg.sink == g and cfg.recent_window == 0 and cfg.clip == "none"
    assert get_config() == PRESETS["k4v2"]
    # the beyond-the-paper preset: k2v2 with MSE-clipped 2-bit key ranges, nothing else
    assert PRESETS["k2v2_clip"] == get_config("k2v2", clip="mse")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_config().key_bits = 2


@pytest.mark.parametrize("field, value, allowed", [
    ("key_bits", 5, "one of (2, 3, 4, 8)"),
    ("value_bits", True, "one of (2, 3, 4, 8)"),
    ("group_size", 100, "one of (32, 64, 128, 256)"),
    ("sinkhorn_iters", -1, "an int in [0, 64]"),
    ("sink_tokens", 100, "multiple of group_size=128"),
    ("recent_window", 64, "multiple of group_size=128"),
    ("scale_dtype", "fp8", "one of ('float16'"),
    ("method", "quarot", "one of ('kvarn', 'kivi', 'hadamard')"),
])
def test_invalid_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        KVarNConfig(**{field: value})
    msg = str(info.value)
    assert f"KVarNConfig.{field}" in msg and repr(value) in msg and allowed in msg


def test_get_config_overrides_and_unknown_names():
    cfg = get_config("k2v2", method="kivi", recent_window=128)
    assert (cfg.key_bits, cfg.method, cfg.recent_window) == (2, "kivi", 128)
    assert cfg.short() == "kivi-k2v2-g128-r128"
    with pytest.raises(ValueError, match="Unknown KVarN preset 'k3v3'"):
        get_config("k3v3")
    with pytest.raises(ValueError, match="no field"):
        get_config("k4v2", bitz=3)
    assert get_config(scale_dtype="float8_e4m3fn").torch_scale_dtype == torch.float8_e4m3fn
