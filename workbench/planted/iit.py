"""Models trained with strict interchange intervention training (SIIT) to put a known causal graph on chosen components.

Interchange intervention training (Geiger et al. 2022) maps each node of a high-level
causal model onto one component of the network (here a head, or an MLP) and trains the
network so that swapping that component's activation between two inputs changes the output
exactly as swapping the node's value changes the high-level model's output. Strict IIT
(InterpBench, Gupta et al. 2024) adds the other half: swapping any component *not* in the
mapping must leave the output alone. Each step therefore has three losses on a base and a
source batch:

    behaviour   cross-entropy of the model on the base labels
    IIT         one circuit node patched from the source run; labels from the high-level model
                with that node's value taken from the source
    SIIT        one head outside the circuit patched from the source; labels of the base

Two tasks of the repo's own, each small enough to train in about a minute on one core:

    iit-induction  the induction task (``workbench.data.induction``): P = "the previous token"
                   on L0H2, I = "copy what followed the last earlier occurrence" on L1H1, which
                   reads P through its key: the circuit of an induction head by K-composition.
    iit-modular    a + b mod p (``workbench.data.modular``, p = 17): A = a on L0H1, B = b on L0H3,
                   S = (A + B) mod p on the MLP, which reads both heads.

The ground truth is the edge set the high-level graph implies; edges whose role the objective
does not decide (how a head finds its position: its q and k inputs) are listed as unscored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.config import ModelConfig
from workbench.data.induction import InductionTask
from workbench.data.modular import ModularTask
from workbench.model import HookedDecoder
from workbench.utils import eval_mode

IGNORE = -100


@dataclass(frozen=True)
class Component:
    """A head (``layer``, ``head``) or, with ``head=None``, the MLP of ``layer``."""

    layer: int
    head: int | None = None

    @property
    def hook(self) -> str:
        return f"blocks.{self.layer}.attn.hook_z" if self.head is not None else f"blocks.{self.layer}.hook_mlp_out"

    @property
    def label(self) -> str:
        return f"L{self.layer}H{self.head}" if self.head is not None else f"L{self.layer} mlp"


@dataclass
class IITSpec:
    """One task: the model, the mapping of high-level nodes to components, data and labels."""

    name: str
    config: ModelConfig
    nodes: dict[str, Component]
    sample: Callable[[int, torch.Generator], Tensor]
    labels: Callable[[Tensor], Tensor]
    counterfactual: Callable[[Tensor, Tensor, str], Tensor]
    truth: list[str]
    unscored: list[str]
    prompts: dict
    train: dict = field(default_factory=dict)


# ---- induction ------------------------------------------------------------------------------------
def copy_labels(query: Tensor, prev: Tensor, values: Tensor) -> Tensor:
    """For each position i, the value at the position j <= i whose previous token equals token i,
    when every such j agrees on it; else IGNORE. The high-level induction model."""
    n = query.shape[1]
    match = (prev[:, None, :] == query[:, :, None]) & torch.ones(n, n, dtype=torch.bool).tril()
    high = torch.where(match, values[:, None, :], -1).amax(-1)
    low = torch.where(match, values[:, None, :], 1 << 30).amin(-1)
    return torch.where(match.any(-1) & (high == low), high, IGNORE)


def _previous(tokens: Tensor) -> Tensor:
    return torch.cat([torch.full_like(tokens[:, :1], -1), tokens[:, :-1]], dim=1)


def induction_spec() -> IITSpec:
    vocab, seq_len = 32, 24
    task = InductionTask(seed=0, vocab=vocab, seq_len=seq_len, segment_min=4, segment_max=8, gap_max=4)
    config = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_vocab=vocab, n_ctx=seq_len, attn_only=True,
                         positional="rope", tie_embeddings=False, name="planted-iit-induction", seed=0)

    def labels(base: Tensor) -> Tensor:
        return copy_labels(base, _previous(base), base)

    def counterfactual(base: Tensor, source: Tensor, node: str) -> Tensor:
        if node == "P":  # the previous tokens come from the source; the query and the copied value from the base
            return copy_labels(base, _previous(source), base)
        return labels(source)  # I: the copy itself comes from the source

    return IITSpec(
        name="iit-induction", config=config, nodes={"P": Component(0, 2), "I": Component(1, 1)},
        sample=lambda n, gen: task.sample(n, seq_len, gen), labels=labels, counterfactual=counterfactual,
        truth=["embed -> L0H2.v", "L0H2 -> L1H1.k", "embed -> L1H1.q", "embed -> L1H1.v", "L1H1 -> logits"],
        unscored=["embed -> L0H2.q", "embed -> L0H2.k", "embed -> L1H1.k"],
        prompts={"kind": "repeat", "half": 10, "vocab": vocab, "bos": None, "distinct": True},
        train={"steps": 1200, "batch": 64, "lr": 3e-3},
    )


# ---- modular addition ----------------------------------------------------------------------------
def modular_spec(p: int = 17) -> IITSpec:
    task = ModularTask(seed=0, p=p, train_fraction=0.5)
    config = ModelConfig(d_model=64, n_layers=1, n_heads=4, d_mlp=256, d_vocab=p + 2, n_ctx=4, ffn="relu",
                         positional="learned", tie_embeddings=False, name="planted-iit-modular", seed=0)

    def operands(tokens: Tensor) -> tuple[Tensor, Tensor]:
        return tokens[:, 0], tokens[:, 2]

    def answer_at_end(value: Tensor) -> Tensor:
        out = torch.full((value.shape[0], 4), IGNORE, dtype=torch.long)
        out[:, -1] = value % p
        return out

    def sample(n: int, gen: torch.Generator) -> Tensor:
        pairs = torch.randint(0, p, (n, 2), generator=gen)
        return task.sequences(pairs)[:, :4]  # [a, +, b, =]; the answer is predicted at "="

    def labels(base: Tensor) -> Tensor:
        a, b = operands(base)
        return answer_at_end(a + b)

    def counterfactual(base: Tensor, source: Tensor, node: str) -> Tensor:
        (a, b), (a_s, b_s) = operands(base), operands(source)
        return answer_at_end({"A": a_s + b, "B": a + b_s, "S": a_s + b_s}[node])

    return IITSpec(
        name="iit-modular", config=config,
        nodes={"A": Component(0, 1), "B": Component(0, 3), "S": Component(0, None)},
        sample=sample, labels=labels, counterfactual=counterfactual,
        truth=["embed -> L0H1.v", "embed -> L0H3.v", "L0H1 -> L0 mlp", "L0H3 -> L0 mlp", "L0 mlp -> logits"],
        unscored=["embed -> L0H1.q", "embed -> L0H1.k", "embed -> L0H3.q", "embed -> L0H3.k"],
        prompts={"kind": "modular", "p": p},
        train={"steps": 1500, "batch": 128, "lr": 3e-3},
    )


SPECS = {"iit-induction": induction_spec, "iit-modular": modular_spec}


# ---- training ------------------------------------------------------------------------------------
def patched_logits(model: HookedDecoder, base: Tensor, source: Tensor, component: Component) -> Tensor:
    """The base run with ``component``'s activation (all positions) taken from the source run."""
    with torch.no_grad():
        _, cache = model.run_with_cache(source, names_filter=lambda name: name == component.hook)
    replacement = cache[component.hook]

    def swap(act: Tensor, hook) -> Tensor:
        if component.head is None:
            return replacement
        act = act.clone()
        act[:, :, component.head] = replacement[:, :, component.head]
        return act

    return model.run_with_hooks(base, fwd_hooks=[(component.hook, swap)])


def _loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def _accuracy(logits: Tensor, labels: Tensor) -> float:
    keep = labels != IGNORE
    return float((logits.argmax(-1)[keep] == labels[keep]).float().mean())


def others(spec: IITSpec) -> list[Component]:
    """The heads outside the circuit (SIIT patches them)."""
    used = set(spec.nodes.values())
    return [Component(l, h) for l in range(spec.config.n_layers) for h in range(spec.config.n_heads)
            if Component(l, h) not in used]


@torch.no_grad()
def evaluate(model: HookedDecoder, spec: IITSpec, batch: int = 512, seed: int = 12345) -> dict[str, float]:
    """Accuracy on the task, interchange accuracy per circuit node (IIA), and the accuracy with each
    outside head patched (SIIT: the base labels must survive), on fresh batches."""
    gen = torch.Generator().manual_seed(seed)
    base, source = spec.sample(batch, gen), spec.sample(batch, gen)
    with eval_mode(model):
        out = {"accuracy": _accuracy(model(base), spec.labels(base))}
        for node, component in spec.nodes.items():
            out[f"iia_{node}"] = _accuracy(patched_logits(model, base, source, component),
                                           spec.counterfactual(base, source, node))
        out["siit_accuracy_min"] = min(_accuracy(patched_logits(model, base, source, c), spec.labels(base))
                                       for c in others(spec))
    return out


def train_iit(spec: IITSpec, steps: int | None = None, seed: int = 0, log: Callable[[str], None] = print
              ) -> tuple[HookedDecoder, dict[str, float]]:
    """Train ``spec``'s model with the three losses; returns (model, ``evaluate``'s metrics and the time)."""
    settings = spec.train
    steps = settings["steps"] if steps is None else steps
    torch.manual_seed(seed)
    model = HookedDecoder(spec.config)
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * max(0.1, 1 - s / steps))
    gen = torch.Generator().manual_seed(seed)
    nodes, outside = list(spec.nodes), others(spec)
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        base, source = spec.sample(settings["batch"], gen), spec.sample(settings["batch"], gen)
        node = nodes[step % len(nodes)]
        component = outside[int(torch.randint(len(outside), (1,), generator=gen))]
        loss_b = _loss(model(base), spec.labels(base))
        loss_iit = _loss(patched_logits(model, base, source, spec.nodes[node]), spec.counterfactual(base, source, node))
        loss_siit = _loss(patched_logits(model, base, source, component), spec.labels(base))
        loss = loss_b + loss_iit + loss_siit
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"{spec.name} step {step + 1}/{steps}: behaviour {loss_b.item():.3f} iit {loss_iit.item():.3f} "
                f"siit {loss_siit.item():.3f}")
    model.eval()
    metrics = evaluate(model, spec)
    metrics["train_seconds"] = time.perf_counter() - started
    return model, metrics
