"""The token store: round trip, lazy reads, and clear errors for damaged files."""

import pickle

import pytest
import torch
from safetensors.torch import save_file

from eaglekit.data.tokens import TokenStore, write_token_store
from eaglekit.errors import EaglekitError


def make_samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(1, 40, (), generator=g))
        ids = torch.randint(0, 150_000, (length,), generator=g)
        mask = (torch.rand(length, generator=g) > 0.5).to(torch.uint8)
        samples.append((f"s{i}", ids.tolist() if i % 2 else ids, mask.tolist() if i % 2 else mask))
    return samples


def test_round_trip(tmp_path):
    samples = make_samples()
    path = tmp_path / "tokens.safetensors"
    assert write_token_store(path, iter(samples)) == len(samples)
    store = TokenStore(path)
    assert len(store) == len(samples) and store.ids == [s[0] for s in samples]
    assert store.lengths.tolist() == [len(s[1]) for s in samples]
    assert store.total_tokens == sum(len(s[1]) for s in samples)
    assert store.assistant_tokens == sum(int(sum(s[2])) for s in samples)
    for (sid, ids, mask), (got_id, got_ids, got_mask) in zip(samples, store, strict=False):
        assert got_id == sid and got_ids.dtype == torch.long
        assert got_ids.tolist() == list(map(int, ids)) and got_mask.tolist() == list(map(int, mask))
    assert store[-1][0] == samples[-1][0]
    with pytest.raises(IndexError):
        store[len(samples)]
    # DataLoader workers get a copy without the open file handle, and re-open it themselves.
    clone = pickle.loads(pickle.dumps(store))
    assert clone[2][1].tolist() == store[2][1].tolist()


def test_empty_store(tmp_path):
    write_token_store(tmp_path / "t.safetensors", [])
    store = TokenStore(tmp_path / "t.safetensors")
    assert len(store) == 0 and store.total_tokens == 0


def test_write_rejects_bad_samples(tmp_path):
    with pytest.raises(EaglekitError, match="3 token ids but 2 mask values"):
        write_token_store(tmp_path / "t.safetensors", [("a", [1, 2, 3], [0, 1])])
    with pytest.raises(EaglekitError, match="duplicate sample ids"):
        write_token_store(tmp_path / "t.safetensors", [("a", [1], [1]), ("a", [2], [1])])
    assert not (tmp_path / "t.safetensors").exists()  # nothing half-written is left behind
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.99])
def test_truncated_file_is_a_clear_error(tmp_path, keep):
    path = tmp_path / "tokens.safetensors"
    write_token_store(path, make_samples())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(EaglekitError, match="truncated or corrupt") as err:
        TokenStore(path)
    assert str(path) in err.value.message and "eaglekit run CONFIG --from prepare" in err.value.remedy


def test_foreign_or_inconsistent_file_is_a_clear_error(tmp_path):
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(3)}, str(foreign))
    with pytest.raises(EaglekitError, match="not an eaglekit token store"):
        TokenStore(foreign)
    lying = tmp_path / "lying.safetensors"
    save_file(
        {
            "input_ids": torch.zeros(4, dtype=torch.int32),
            "loss_mask": torch.zeros(4, dtype=torch.uint8),
            "offsets": torch.tensor([0, 2, 5]),
        },
        str(lying),
        metadata={
            "format": "eaglekit.tokens",
            "version": "1",
            "ids": '["a", "b"]',
            "total_tokens": "4",
            "assistant_tokens": "0",
        },
    )
    with pytest.raises(EaglekitError, match="do not agree"):
        TokenStore(lying)
    with pytest.raises(EaglekitError, match="not found"):
        TokenStore(tmp_path / "missing.safetensors")
