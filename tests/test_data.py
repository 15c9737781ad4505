"""Tasks: each generator is deterministic per seed, and each metric is right on a hand-made case."""

import re

import pytest
import torch
from torch import nn

import workbench as wb
from factories import tiny
from workbench.data import TASKS, answer_metrics, get_task, induction_scores
from workbench.data.stories import NAMES, PromptBatch


@pytest.fixture
def text_file(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "corpus" / "b.md").write_text("pack my box with five dozen liquor jugs! " * 40)
    (tmp_path / "corpus" / ".hidden").write_bytes(b"\xff\xfe not utf-8")
    return tmp_path / "corpus"


def make(name, text_file, seed=0):
    return get_task(name, seed=seed, **({"path": text_file} if name == "text" else {}))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_batches_are_deterministic_per_seed_and_step(name, text_file):
    a, b, other = make(name, text_file), make(name, text_file), make(name, text_file, seed=1)
    seq = 5 if name == "modular" else 32
    batch = a.batch(8, seq, step=3)
    assert batch.shape == (8, seq) and batch.dtype == torch.long
    assert 0 <= int(batch.min()) and int(batch.max()) < a.vocab_size
    assert torch.equal(batch, b.batch(8, seq, step=3))
    assert not torch.equal(batch, a.batch(8, seq, step=4))
    assert not torch.equal(batch, other.batch(8, seq, step=3))
    assert not torch.equal(batch, a.batch(8, seq, step=3, split="val"))
    assert a.description and get_task(name, **a.options()).options() == a.options()


def test_unknown_task_and_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="valid tasks are"):
        get_task("wikipedia")
    with pytest.raises(ValueError, match="path"):
        get_task("text")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="bad.txt is not UTF-8"):
        get_task("text", path=tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="tokenizer"):
        get_task("text", path=tmp_path, tokenizer="sentencepiece")


# ---- induction ----------------------------------------------------------------------------
def test_induction_sequences_contain_a_recurring_segment():
    task = get_task("induction", vocab=50, segment_min=6, segment_max=8, gap_max=4)
    for row in task.batch(16, 48).tolist():
        # some 6-gram occurs at least twice (random 6-grams over 50 tokens essentially never repeat)
        grams = [tuple(row[i : i + 6]) for i in range(len(row) - 5)]
        assert max(grams.count(g) for g in grams) >= 2


def test_induction_score_is_one_for_a_perfect_induction_head_and_small_otherwise():
    cfg = tiny(attn_only=True, positional="rope", d_vocab=64, n_ctx=40)
    model = wb.HookedDecoder(cfg)
    task = get_task("induction", vocab=64)
    tokens = task.repeated_tokens(4, 20)
    assert tokens.shape == (4, 40) and torch.equal(tokens[:, :20], tokens[:, 20:])

    def perfect_head(pattern, hook):  # layer 1 head 2 attends from i to i - n + 1 on the repeat
        pattern = pattern.clone()
        n = 20
        for q in range(n, 2 * n):
            pattern[:, 2, q] = 0.0
            pattern[:, 2, q, q - n + 1] = 1.0
        return pattern

    model.add_hook("blocks.1.attn.hook_pattern", perfect_head, is_permanent=True)
    scores = induction_scores(model, tokens)
    assert list(scores.columns) == ["layer", "head", "score"] and len(scores) == 2 * cfg.n_heads
    best = scores.loc[scores["score"].idxmax()]
    assert (best["layer"], best["head"]) == (1, 2) and best["score"] == pytest.approx(1.0)
    assert scores.drop(index=scores["score"].idxmax())["score"].max() < 0.2  # random init: ~1/position
    with pytest.raises(ValueError, match="repeated tokens"):
        induction_scores(model, torch.randint(0, 64, (2, 40)))
    metrics = task.evaluate(model, batch_size=4, half_len=20)
    assert metrics["induction_score_max"] == pytest.approx(1.0) and (metrics["best_layer"], metrics["best_head"]) == (1, 2)


# ---- modular --------------------------------------------------------------------------------
class _Oracle(nn.Module):
    """Predicts (a + b) mod p right for a fraction of the pairs: a hand-made model with known accuracy."""

    def __init__(self, p, wrong_when_a_below=0):
        super().__init__()
        self.p, self.cut, self.w = p, wrong_when_a_below, nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.w.device

    def forward(self, tokens):
        a, b = tokens[:, 0], tokens[:, 2]
        answer = torch.where(a < self.cut, (a + b + 1) % self.p, (a + b) % self.p)
        logits = torch.zeros(tokens.shape[0], tokens.shape[1], self.p + 2)
        logits[torch.arange(len(a)), -1, answer] = 5.0
        return logits


def test_modular_sequences_and_accuracy_on_a_hand_made_model():
    task = get_task("modular", p=7, train_fraction=0.5)
    assert len(task.train_pairs) + len(task.test_pairs) == 49
    assert not set(map(tuple, task.train_pairs.tolist())) & set(map(tuple, task.test_pairs.tolist()))
    seqs = task.batch(32)
    assert torch.equal(seqs[:, 4], (seqs[:, 0] + seqs[:, 2]) % 7) and (seqs[:, 1] == 7).all() and (seqs[:, 3] == 8).all()
    assert task.evaluate(_Oracle(7)) == {"train_accuracy": 1.0, "test_accuracy": 1.0}
    # wrong exactly when a < 3: accuracy is the fraction of pairs with a >= 3
    for split, pairs in (("train", task.train_pairs), ("test", task.test_pairs)):
        expected = float((pairs[:, 0] >= 3).float().mean())
        assert task.evaluate(_Oracle(7, wrong_when_a_below=3))[f"{split}_accuracy"] == pytest.approx(expected)


# ---- stories --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories():
    return get_task("stories", seed=0)


def test_names_are_single_tokens_and_stories_round_trip(stories):
    tok = stories.tokenizer
    assert all(len(tok.encode(name)) == 1 for name in NAMES)
    for story in stories.stories(30):
        assert 0 not in tok.encode(story)  # the grammar's vocabulary is closed
    assert tok.decode(tok.encode("When Mary and John went to the store, John gave a drink to Mary.")) == \
        "When Mary and John went to the store, John gave a drink to Mary."


def test_heldout_pairs_and_templates_never_occur_in_training_stories(stories):
    heldout = {frozenset(p) for p in stories.heldout_pairs}
    connectives = "When|While|After|Once"
    ioi = re.compile(rf"({connectives}) (\w+) and (\w+) (\w+) (to|at) the \w+, \w+ (\w+) a")
    seen_templates = set()
    for story in stories.stories(400):
        names = {w for w in re.findall(r"\w+", story) if w in NAMES}
        assert frozenset(names) not in heldout
        seen_templates.update((m[0], m[3], m[5]) for m in ioi.findall(story))
    from workbench.data.stories import CONNECTIVES, GIVES, MOVES
    heldout_templates = {(CONNECTIVES[c], MOVES[m][0], GIVES[g]) for c, m, g in stories.heldout_templates}
    assert seen_templates and not seen_templates & heldout_templates


def test_ioi_prompts_have_the_right_answers_and_positions(stories):
    batch = stories.ioi_prompts(20, seed=3)
    assert batch.tokens.shape == batch.corrupted.shape == (20, 15)
    for i in range(20):
        ids = batch.tokens[i].tolist()
        io, s = int(batch.correct[i]), int(batch.wrong[i])
        assert ids.count(io) == 1 and ids.count(s) == 2  # the indirect object is the name mentioned once
        assert ids[batch.positions["IO"][i]] == io and ids[batch.positions["S1"][i]] == s == ids[batch.positions["S2"][i]]
        diff = (batch.tokens[i] != batch.corrupted[i]).nonzero().flatten().tolist()
        assert diff == [int(batch.positions["S2"][i])]  # the ABC baseline changes only S2
        assert frozenset(stories.tokenizer.itos[t] for t in (io, s)) in {frozenset(p) for p in stories.heldout_pairs}
    assert torch.equal(batch.tokens, stories.ioi_prompts(20, seed=3).tokens)
    assert batch.prompts[0].startswith("\n") and stories.tokenizer.encode(batch.prompts[0]) == batch.tokens[0].tolist()
    assert {"ABBA", "BABA"} == set(batch.templates)


def test_possession_prompts_answer_the_asked_owners_object(stories):
    batch = stories.possession_prompts(10, seed=1)
    itos = stories.tokenizer.itos
    for i, prompt in enumerate(batch.prompts):
        m = re.match(r"\n(\w+) has a (\w+) and (\w+) has a (\w+)\. (\w+) plays with the$", prompt)
        assert m, prompt
        owner_to_obj = {m[1]: m[2], m[3]: m[4]}
        assert itos[batch.correct[i]] == owner_to_obj[m[5]] and itos[batch.wrong[i]] != itos[batch.correct[i]]


class _Scripted(nn.Module):
    """Last-position logits: +d on the correct token for the first k prompts, +d on the wrong one after."""

    def __init__(self, batch: PromptBatch, k: int, d: float, vocab: int):
        super().__init__()
        self.batch, self.k, self.d, self.vocab, self.w = batch, k, d, vocab, nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.w.device

    def forward(self, tokens):
        logits = torch.zeros(tokens.shape[0], tokens.shape[1], self.vocab)
        for i in range(tokens.shape[0]):
            target = self.batch.correct[i] if i < self.k else self.batch.wrong[i]
            logits[i, -1, target] = self.d
        return logits


def test_answer_metrics_on_a_hand_made_model(stories):
    batch = stories.ioi_prompts(8)
    metrics = answer_metrics(_Scripted(batch, k=6, d=2.0, vocab=stories.vocab_size), batch)
    assert metrics["accuracy"] == pytest.approx(6 / 8)
    assert metrics["logit_diff"] == pytest.approx((6 * 2.0 - 2 * 2.0) / 8)
    assert metrics["top1"] == pytest.approx(6 / 8)


def test_stories_evaluate_reports_chance_for_an_untrained_model(stories):
    model = wb.HookedDecoder(tiny(d_vocab=stories.vocab_size, n_ctx=32))
    metrics = stories.evaluate(model, n=64)
    assert {"ioi_accuracy", "ioi_logit_diff", "ioi_seen_templates_accuracy", "possession_accuracy"} <= set(metrics)
    assert abs(metrics["ioi_logit_diff"]) < 0.1  # random init: no preference between the two names


# ---- text -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_text_task_splits_a_folder_and_evaluates(text_file, kind):
    task = get_task("text", path=text_file, tokenizer=kind, vocab_size=300, val_fraction=0.25)
    total = len(task.train_ids) + len(task.val_ids)
    assert 0.15 < len(task.val_ids) / total < 0.35
    decoded = task.tokenizer.decode(task.train_ids[:40].tolist())
    assert decoded.startswith("the quick brown fox")  # a.txt first (sorted), the hidden file skipped
    model = wb.HookedDecoder(tiny(d_vocab=task.vocab_size, n_ctx=16))
    metrics = task.evaluate(model, seq_len=16)
    assert metrics["val_loss"] > 0 and metrics["perplexity"] == pytest.approx(torch.tensor(metrics["val_loss"]).exp().item(), rel=1e-5)
