"""The copy model's training rows (scripts/make_copy_model.py) are what its docstring says:
the loss falls only on tokens that copying predicts.  No training here: rows, masks and a
fresh model's config and save format (seconds)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenloom.bundled import BUNDLED_MODEL_DIR
from tokenloom.model.tools.tokenizer_builder import EOS_ID

from script_modules import SCRIPTS, load_script

mcm = load_script("make_copy_model")

TEXTS = [(SCRIPTS.parent / "tokenloom" / p).read_text() for p in ("core/scheduler.py", "config.py", "request.py")]


def _rows(seed: int = 0, **overrides) -> tuple[object, object]:
    args = mcm.parse_args(["--context", "128", "--batch-size", "4"])
    for k, v in overrides.items():
        setattr(args, k, v)
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    return mcm.RowMaker(tok, TEXTS, args, random.Random(seed)), tok


def test_random_example_loss_is_on_the_repeat_only() -> None:
    rows, _ = _rows()
    lengths = set()
    for _ in range(200):
        ids, mask = rows.random_example()
        assert len(ids) == len(mask) and mask[-1] == 1
        first = mask.index(1)
        n = len(ids) - first + 1  # the run's length: its repeat is masked in from its second token
        lengths.add(n)
        assert ids[-2 * n:-n] == ids[-n:]  # the masked tokens repeat the run before them
        assert sum(mask) == n - 1 and all(mask[first:])
        assert min(ids) >= mcm.FIRST_ORDINARY_ID
    assert min(lengths) == rows.args.min_run and max(lengths) == rows.args.max_run  # lengths vary


def test_copy_example_loss_is_on_the_second_copy() -> None:
    rows, tok = _rows(seed=1, edit_frac=0.0)
    for _ in range(20):
        ids, mask = rows.copy_example()
        first = mask.index(1)
        assert all(mask[first:]) and not any(mask[:first])
        copy = tok.decode(ids[first:])
        source = tok.decode(ids[:first])
        assert copy.strip() and copy.strip() in source  # the masked part repeats the snippet


def test_edit_examples_change_one_line_of_the_copy() -> None:
    rows, tok = _rows(seed=2, edit_frac=1.0)
    changed = 0
    for _ in range(20):
        ids, mask = rows.copy_example()
        first = mask.index(1)
        copy_lines = tok.decode(ids[first:]).splitlines()
        source = tok.decode(ids[:first])
        changed += sum(line not in source for line in copy_lines) >= 1
    assert changed >= 15  # the donor line can happen to occur in the snippet too


def test_rows_have_the_width_and_the_mixture() -> None:
    rows, _ = _rows(seed=3)
    ids, mask = rows.batch()
    assert ids.shape == mask.shape == (4, 129) and ids.dtype == torch.long and mask.dtype == torch.bool
    kinds = {"plain": 0, "packed": 0}
    for _ in range(60):
        i, m = rows.row()
        assert len(i) == len(m) == 129 and i[0] == EOS_ID
        kinds["plain" if all(m) else "packed"] += 1
    assert kinds["plain"] and kinds["packed"]


def test_lr_warms_up_holds_then_decays_to_a_tenth() -> None:
    args = mcm.parse_args(["--induction-steps", "50", "--steps", "50", "--warmup-steps", "10", "--lr", "1e-3"])
    assert mcm.lr_at(0, args) == 1e-4 and abs(mcm.lr_at(9, args) - 1e-3) < 1e-12
    assert mcm.lr_at(49, args) == 1e-3  # constant through phase 1
    assert mcm.lr_at(75, args) < mcm.lr_at(60, args) and abs(mcm.lr_at(100, args) - 1e-4) < 1e-12


def test_fresh_model_saves_as_a_loadable_checkpoint(tmp_path: Path) -> None:
    args = mcm.parse_args(["--out", str(tmp_path), "--layers", "1", "--hidden", "64"])
    model = mcm.build_model(args, 4096)
    mcm.save(model, args, {"test": True})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.num_hidden_layers == 1 and loaded.config.hidden_size == 64
    assert AutoTokenizer.from_pretrained(tmp_path).encode("x = 1") == \
        AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR).encode("x = 1")
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)
