"""Shared options: sizes, devices, and their usage errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import SAMPLE

from rolloutcli import RolloutError
from rolloutcli.pipeline.options import RunOptions, parse_size, resolve_device


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64K", 65536),
        ("256M", 256 << 20),
        ("2G", 2 << 30),
        ("1.5G", 3 << 29),
        ("1048576", 1 << 20),
        ("2GiB", 2 << 30),
        ("512kb", 512 << 10),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "12X", "100"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(RolloutError) as error:
        parse_size(text)
    assert error.value.exit_code == 2 and "--max-memory" in str(error.value)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert RunOptions.from_cli().device == "cpu"  # commands without --device
    with pytest.raises(RolloutError, match="expected auto, cpu, cuda or cuda:<index>, found 'tpu'"):
        resolve_device("tpu")


def test_cpu_never_imports_torch() -> None:
    # inspect, gae and batch run on the CPU: none of them loads torch to resolve a device.
    code = (
        "import sys; from rolloutcli.pipeline.options import RunOptions, resolve_device; "
        "assert resolve_device('cpu') == 'cpu' and RunOptions.from_cli().device == 'cpu'; "
        "assert RunOptions.from_cli(max_memory='64K').device == 'cpu'; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_asks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def test_huge_sizes_are_usage_errors() -> None:
    for text in ("9" * 400, "2000T", "1" + "0" * 30 + "G"):
        with pytest.raises(RolloutError, match="expected at most 1024T") as error:
            parse_size(text)
        assert error.value.exit_code == 2
    assert parse_size("1024T") == 1 << 50


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_gpu_is_a_usage_error(cli) -> None:
    code, out, err = cli("split", SAMPLE, "-o", "never.h5", "--device", "cuda")
    assert code == 2 and out == ""
    assert "no CUDA GPU is visible. Use --device cpu or --device auto." in err


def test_bad_memory_option_through_cli(cli) -> None:
    code, _, err = cli("inspect", SAMPLE, "--max-memory", "lots")
    assert code == 2
    assert err.strip() == "error: --max-memory: expected a size such as 64K, 256M or 2G, found 'lots'."
