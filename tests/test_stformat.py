"""tracedump's own safetensors writer against safetensors' ``save_file``: the same bytes, read back."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tracedump.dump.writer import STORABLE_DTYPES, save_tensors_atomic
from tracedump.store import stformat


def _every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per storable dtype, values that are not all zero, plus the awkward shapes."""
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for dtype in sorted(STORABLE_DTYPES, key=str):
        raw = torch.randint(0, 256, (3, 4), dtype=torch.uint8, generator=generator)
        if dtype == torch.bool:
            tensors["bool"] = raw % 2 == 1
        elif torch.empty(0, dtype=dtype).element_size() == 1:
            tensors[str(dtype)] = raw.view(dtype)
        else:
            tensors[str(dtype)] = (torch.randn(3, 4, generator=generator) * 100).to(dtype)
    tensors["bf16.wide"] = torch.randn(7, 33, generator=generator).bfloat16()
    tensors["empty"] = torch.zeros(0, 4)
    tensors["empty.bf16"] = torch.zeros(2, 0, dtype=torch.bfloat16)
    tensors["scalar"] = torch.tensor(3.5)
    tensors['ünïcode "quoted"\n'] = torch.arange(5)
    return tensors


def _read(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data


@pytest.mark.parametrize("metadata", [{"tracedump.order": '["a", "b\\u00e9"]\t\u0001é'}, {}, None])
def test_same_bytes_as_save_file(tmp_path: Path, metadata: dict[str, str] | None) -> None:
    tensors = _every_dtype()

    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    size = stformat.write_file(tensors, tmp_path / "ours.safetensors", metadata)

    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    assert size == len(ours)
    assert (8 + struct.unpack("<Q", ours[:8])[0]) % 8 == 0  # padded with spaces, as safetensors pads


def test_non_contiguous_inputs_are_written_as_their_contiguous_copies(tmp_path: Path) -> None:
    base = torch.randn(6, 8)
    tensors = {"t": base.t(), "slice": base[:, 1::2], "bf16": base.bfloat16()[::2]}
    assert not any(t.is_contiguous() for t in tensors.values())

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    stformat.write_file(tensors, tmp_path / "ours.safetensors")

    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_several_metadata_keys_keep_their_order_and_the_rest_is_identical(tmp_path: Path) -> None:
    """safetensors writes metadata keys in a hash map's order (it changes per process); ours keeps
    insertion order. Everything else, tensors and offsets included, is byte for byte the same."""
    tensors = _every_dtype()
    metadata = {"z": "1", "a": "2", "tracedump.order": json.dumps(list(tensors))}

    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    stformat.write_file(tensors, tmp_path / "ours.safetensors", metadata)

    ours, our_bytes = _read(tmp_path / "ours.safetensors")
    theirs, their_bytes = _read(tmp_path / "theirs.safetensors")
    assert list(ours["__metadata__"]) == list(metadata)
    assert ours == theirs and list(ours) == list(theirs)
    assert len(our_bytes) == len(their_bytes)
    assert our_bytes[-100:] == their_bytes[-100:]


def test_safe_open_reads_every_tensor_back(tmp_path: Path) -> None:
    tensors = _every_dtype()
    path = tmp_path / "pass00000.safetensors"

    size = save_tensors_atomic(path, tensors, {"tracedump.mode": "full"})

    assert size == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temp file was renamed onto it
    with safe_open(str(path), framework="pt") as handle:
        assert json.loads(handle.metadata()["tracedump.order"]) == list(tensors)
        for name, tensor in tensors.items():
            back = handle.get_tensor(name)
            assert back.dtype == tensor.dtype and back.shape == tensor.shape
            assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """writev may write less than asked; the rest follows from where it stopped."""
    tensors = {"a": torch.randn(1000), "b": torch.randn(3, 7).bfloat16()}
    real = stformat.os.writev

    def at_most_100_bytes(fd: int, buffers: list[memoryview]) -> int:
        return real(fd, [memoryview(b"".join(bytes(b) for b in buffers)[:100])])

    monkeypatch.setattr(stformat.os, "writev", at_most_100_bytes)
    stformat.write_file(tensors, tmp_path / "ours.safetensors")
    monkeypatch.undo()
    save_file(tensors, str(tmp_path / "theirs.safetensors"))

    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_without_preallocation_the_file_is_the_same(tmp_path: Path) -> None:
    """Where fallocate is missing or refused (not every file system has it), the write goes on."""
    tensors = _every_dtype()
    stformat.write_file(tensors, tmp_path / "with.safetensors")
    stformat.write_file(tensors, tmp_path / "without.safetensors", preallocate=False)

    def refused(fd: int, mode: int, offset: int, length: int) -> int:
        stformat.ctypes.set_errno(stformat.errno.EOPNOTSUPP)
        return -1

    stformat.write_file(tensors, tmp_path / "refused.safetensors", preallocate=refused)

    data = (tmp_path / "with.safetensors").read_bytes()
    assert (tmp_path / "without.safetensors").read_bytes() == data
    assert (tmp_path / "refused.safetensors").read_bytes() == data


def test_a_full_disk_is_reported_by_the_preallocation(tmp_path: Path) -> None:
    def full(fd: int, mode: int, offset: int, length: int) -> int:
        stformat.ctypes.set_errno(stformat.errno.ENOSPC)
        return -1

    with pytest.raises(OSError, match="No space left"):
        stformat.write_file({"x": torch.ones(4)}, tmp_path / "x.safetensors", preallocate=full)
