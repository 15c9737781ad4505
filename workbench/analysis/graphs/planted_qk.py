"""QK attribution scored against planted circuits: are the planted K-compositions the top QK pairs?

    pairs = planted_qk_pairs(planted.truth, planted.unscored)       # {head: (planted, unscored) pairs}
    summary, entries = score_planted_qk(planted, n_prompts=32, seed=0)

A planted circuit names edges into heads' queries and keys: ``embed -> L1H0.q`` (the query reads
the token) and ``L0H0 -> L1H0.k`` (the key reads the previous-token head: K-composition). Its
planted QK pairs for head B are every (query-side node, key-side node) with both edges in the
truth: ``a -> B.q`` and ``b -> B.k`` give the pair (a at the query, b at the key), ``embed`` being
the token node. A pair with an edge the truth leaves unscored is unscored (left out of both
counts). The pairs are scored at the entries where the circuit acts: on the planted prompt set
(``[bos?, r, r]``), each query in the second copy of ``r`` that predicts a next token, with the
key just after the earlier occurrence of the query's token (``k = q - half + 1``).

At such an entry the predicted pairs are the top pairs: every pair whose contribution is at least
``ratio`` (default 0.5) of the largest contribution there. Precision is the share of predicted
pairs that are planted, recall the share of planted pairs that are predicted, both pooled over
every entry of every prompt; ``top1`` is the share of entries whose largest pair is planted.
"""

from __future__ import annotations

import re

_EDGE = re.compile(r"^(embed|L\d+H\d+) -> (L\d+H\d+)\.([qk])$")


def planted_qk_pairs(truth, unscored=()) -> dict[str, tuple[set, set]]:
    """{head: (planted pairs, unscored pairs)}; a pair is (query-side sender, key-side sender),
    each ``"embed"`` or a head label such as ``"L0H0"``. Heads without both a query and a key edge
    in the truth have no planted pairs and are left out."""
    def senders(edges) -> dict:
        out: dict = {}
        for edge in edges:
            m = _EDGE.match(edge)
            if m:
                out.setdefault((m[2], m[3]), set()).add(m[1])
        return out

    true, loose = senders(truth), senders(unscored)
    heads = {head for head, side in true}
    out = {}
    for head in sorted(heads):
        q_true, k_true = true.get((head, "q"), set()), true.get((head, "k"), set())
        if not (q_true and k_true):
            continue
        q_all, k_all = q_true | loose.get((head, "q"), set()), k_true | loose.get((head, "k"), set())
        planted = {(a, b) for a in q_true for b in k_true}
        out[head] = (planted, {(a, b) for a in q_all for b in k_all} - planted)
    return out


def _sender(kind: str, unit: str, layer: int, index: int) -> str:
    """A QK row's node as a truth sender: "embed" for a token, "L0H2" for a head, else its position-free unit."""
    if kind == "token":
        return "embed"
    if kind == "head":
        return f"L{layer}H{index}"
    return unit


def score_planted_qk(planted, n_prompts: int = 32, seed: int = 0, ratio: float = 0.5):
    """(summary dict, per-entry DataFrame) of QK attribution against ``planted``'s QK pairs
    (a ``workbench.planted.Planted``) on ``n_prompts`` prompts of its prompt set drawn with ``seed``."""
    import pandas as pd

    from workbench.analysis.graphs.attribute import attribution_graph
    from workbench.analysis.graphs.qk import QKContext, _attribution

    spec = planted.prompt_spec
    if spec.get("kind") != "repeat":
        raise ValueError(f"planted QK pairs are scored on repeat prompts; {planted.name!r} has {spec.get('kind')!r}")
    pairs = planted_qk_pairs(planted.truth, planted.unscored)
    if not pairs:
        raise ValueError(f"{planted.name!r}'s truth has no head with both a query and a key edge: no QK pairs")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must lie in (0, 1], got {ratio}")
    model = planted.model
    clean, _ = planted.prompts(n_prompts, seed=seed)
    half, start = spec["half"], 1 if spec.get("bos") is not None else 0
    queries = range(start + half, start + 2 * half - 1)
    graphs = attribution_graph(model, None, clean, max_n_logits=1)
    graphs = graphs if isinstance(graphs, list) else [graphs]  # one prompt: one graph
    rows = []
    for b, graph in enumerate(graphs):
        ctx = QKContext(graph)
        for head, (true, loose) in pairs.items():
            layer, h = (int(x) for x in re.findall(r"\d+", head))
            for q in queries:
                k = q - half + 1
                frame = _attribution(ctx, layer, h, q, k, None, 0)  # ctx just made: no weight check per entry
                found = [(_sender(*row[:4]), _sender(*row[4:])) for row in zip(
                    frame.query_kind, frame.query_unit, frame.query_layer, frame.query_index,
                    frame.key_kind, frame.key_unit, frame.key_layer, frame.key_index)]
                keep = [i for i, pair in enumerate(found) if pair not in loose]
                values = frame.contribution.to_numpy()[keep]
                named = [found[i] for i in keep]
                best = float(values.max()) if len(values) else 0.0
                # the top pair is the largest signed one, as `predicted` reads them (the frame is ordered by size)
                top = named[int(values.argmax())] if len(values) else None
                predicted = {pair for pair, v in zip(named, values) if best > 0 and v >= ratio * best}
                pattern = float(ctx.cache[f"blocks.{layer}.attn.hook_pattern"][h, q, k])
                rows.append(dict(prompt=b, head=head, query_pos=q, key_pos=k, pattern=pattern,
                                 score=frame.attrs["score"], n_predicted=len(predicted), n_planted=len(true),
                                 n_hit=len(predicted & true), top1=top is not None and top in true,
                                 top_pair=" x ".join(top) if top is not None else ""))
    entries = pd.DataFrame(rows)
    hit = entries.n_hit.sum()
    summary = dict(model=planted.name, prompts=n_prompts, seed=seed, ratio=ratio, entries=len(entries),
                   heads=",".join(pairs), planted_pairs=";".join(f"{h}: " + ", ".join(f"{a} x {b}" for a, b in sorted(t))
                                                         for h, (t, _) in pairs.items()),
                   qk_precision=float(hit / max(1, entries.n_predicted.sum())),
                   qk_recall=float(hit / max(1, entries.n_planted.sum())), qk_top1=float(entries.top1.mean()))
    return summary, entries

