"""Draft vocabulary selection: the most frequent assistant tokens, sorted by id; short vocabularies are filled
with the lowest unused ids; d2t/t2d map them the way the servers read them (target = draft + d2t[draft])."""

from __future__ import annotations

import torch

from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.stages.vocab import select_draft_vocab


def test_most_frequent_tokens_sorted_by_id():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 2])
    selected, fill = select_draft_vocab(counts, 3)
    assert selected.tolist() == [1, 3, 5] and fill == 0
    d2t, t2d = build_d2t_t2d(selected, len(counts))
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 5]
    assert t2d.nonzero().flatten().tolist() == [1, 3, 5]


def test_short_vocabulary_is_filled_with_lowest_unused_ids():
    counts = torch.tensor([0, 0, 4, 0, 3, 0])
    selected, fill = select_draft_vocab(counts, 4)
    assert fill == 2
    assert selected.tolist() == [0, 1, 2, 4]


def test_ties_are_broken_by_id_deterministically():
    counts = torch.tensor([2, 2, 2, 2])
    assert select_draft_vocab(counts, 2)[0].tolist() == select_draft_vocab(counts.clone(), 2)[0].tolist() == [0, 1]
