import json

import torch

from selfspec.training.data import function_prompts, is_held_out, split_corpus
from selfspec.engine.forward.masks import joint_training_allowed
from selfspec.checkpoint.model import NemotronLabsDiffusionModel
from selfspec.training.train import main, noise_block_types


def test_a_few_training_steps_on_a_tiny_slice_save_a_loadable_resumable_model(tmp_path):
    out, run = tmp_path / "m", tmp_path / "run"
    args = ["--out", str(out), "--run-dir", str(run), "--max-files", "4", "--vocab", "400", "--hidden", "32",
            "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--seq-len", "32", "--batch", "2",
            "--block", "8", "--steps", "3", "--threads", "1", "--seed", "1"]
    summary = main(args)
    assert summary["steps"] == 3 and (run / "state.pt").is_file()
    model = NemotronLabsDiffusionModel.from_pretrained(out)
    assert model.config.mask_token_id == 4 and model.config.vocab_size == 400
    assert json.loads((out / "training.json").read_text())["steps"] == 3
    resumed = main(args[:-6] + ["--steps", "5", "--threads", "1", "--seed", "1"])  # resumes at step 3
    assert resumed["steps"] == 5


def test_noise_patterns_cover_full_seed_and_random_blocks():
    g = torch.Generator().manual_seed(0)
    m = noise_block_types(64, 32, 8, 3, g, p_full=0.45, p_seed=0.35)
    blocks = [(s, min(s + 8, 32)) for s in [0] + list(range(5, 32, 8))]  # offset 3: block starts at 0, 5, 13, ...
    kinds = set()
    for row in m:
        for a, b in blocks:
            seg = row[a:b]
            kinds.add("full" if seg.all() else "seed" if (not seg[0] and seg[1:].all()) else "other")
    assert kinds == {"full", "seed", "other"}


def test_training_mask_never_lets_clean_tokens_see_noisy_ones():
    a = joint_training_allowed(16, 4, offset=2)
    assert not a[16:, :16].any()
    assert torch.equal(a[16:, 16:], torch.ones(16, 16, dtype=torch.bool).tril())


def test_held_out_files_are_never_in_the_training_split_and_prompts_come_from_them():
    train, held = split_corpus()
    assert held and not any(is_held_out(rel) for rel, _ in train)
    assert all(is_held_out(rel) for rel, _ in held)
    prompts = function_prompts(held, limit=50)
    assert len(prompts) == 50
    held_names = {rel for rel, _ in held}
    assert all(p["id"].rsplit(":", 1)[0] in held_names for p in prompts)
