"""Reading and writing attribution-graph files: ours (``Graph.save`` / ``Graph.load``) and
circuit-tracer's graph JSON (``Graph.to_circuit_tracer`` / ``Graph.from_circuit_tracer``).

Every read goes through one validated reader. A file is refused (one ``ValueError`` naming the
file and the field) when it is over the size cap (``max_bytes``, checked with ``os.stat`` before
a byte is read), not JSON, nested deeper than any graph file is, or when a field has the wrong
type or shape, a number that is not finite, an index out of range, a node that appears twice, an
edge to a node that does not exist or that no attribution graph has (into a token, out of a
logit, from a later layer or a later position: such an edge could make a cycle), or a negative
logit weight. So a file that loads is a graph every method of ``Graph`` can answer for.

Every write names its own files: ``save`` replaces only a file of ours (or, with
``overwrite=True``, the file named), atomically; ``to_circuit_tracer`` writes ``{slug}.json``
and the folder's listing ``graph-metadata.json`` only, refuses a slug that is not a plain name,
reads and checks the listing before writing anything, and replaces the listing atomically.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from workbench.overwrite import write_atomic

GRAPH_FORMAT = "workbench-attribution-graph"
GRAPH_VERSION = 1
LISTING = "graph-metadata.json"  # circuit-tracer's listing of the graphs in a folder (its add_graph_metadata)
DEFAULT_MAX_BYTES = 256 * 2**20  # about 10 million edges in our format; loading takes several times the file's size
MAX_DEPTH = 64  # nesting allowed inside meta and the qk table (a graph file itself is 3 deep)
_INT_FIELDS = ("kind", "layer", "pos", "feature", "edge_target", "edge_source", "tokens")
_FLOAT_FIELDS = ("activation", "logit_weight", "edge_weight")
_NODE_FIELDS = ("kind", "layer", "pos", "feature", "activation", "logit_weight")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT_BOUND = 2**62
# circuit-tracer's feature_type names; "transcoder" is what some of its versions write for per-layer transcoders
_CT_KINDS = {"cross layer transcoder": 0, "transcoder": 0, "CLT": 0, "mlp reconstruction error": 1, "mlp_error": 1,
             "embedding": 2, "logit": 3}
_OUR_MARK = ('{"format": "%s"' % GRAPH_FORMAT).encode()  # how every file save writes begins


# ---- reading JSON within bounds ----------------------------------------------------------------------------
def read_json(path: Union[str, Path], max_bytes: Optional[int] = DEFAULT_MAX_BYTES, what: str = "graph file") -> Any:
    """The parsed JSON of ``path``: a ValueError when it is missing, not a file, over ``max_bytes``
    (None: no cap), not JSON or nested too deeply, never an OSError, a RecursionError or a read of
    more than ``max_bytes``."""
    path = Path(path)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive whole number of bytes or None, got {max_bytes!r}")
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:  # missing, a name too long, a NUL
        raise ValueError(f"cannot read the {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"the {what} {path} is not a file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ValueError(f"the {what} {path} is {st.st_size:,} bytes, over the cap of {max_bytes:,} (max_bytes=); "
                         f"pass a larger max_bytes= if you trust it")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1 if max_bytes is not None else -1)  # it may have grown since the stat
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"the {what} {path} is over the cap of {max_bytes:,} bytes (max_bytes=)")
    try:
        text = data.decode("utf-8")  # json.loads of bytes would hold the bytes and a decoded copy at once
    except UnicodeDecodeError as e:
        raise ValueError(f"the {what} {path} is not UTF-8 text ({e})") from None
    del data
    return parse_json(text, f"the {what} {path}")


def parse_json(data: Union[bytes, str], where: str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:  # the C decoder refuses deep nesting with one; nothing of ours nests that deep
        raise ValueError(f"{where} is nested too deeply to be a graph file") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where} is not valid JSON ({e})") from None


def _check_depth(value: Any, field: str, limit: int = MAX_DEPTH) -> None:
    """A ValueError when ``value`` nests lists and dicts deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"{field} is nested more than {limit} levels deep")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


# ---- field checks ------------------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _array(value: Any, field: str, integer: bool, ndim: int = 1) -> np.ndarray:
    """``value`` (a JSON list) as int64 / float32 numbers: finite, whole where ``integer``, within range."""
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a list of numbers, got {_type_name(value)}")
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise ValueError(f"{field} must be a list of numbers (it is ragged or mixes types)") from None
    if a.size == 0:
        return np.zeros((0,) * ndim, dtype=np.int64 if integer else np.float32)
    if a.ndim != ndim:
        raise ValueError(f"{field} must be a {ndim}-dimensional list of numbers, got {a.ndim} dimensions")
    if a.dtype.kind not in "iuf":
        raise ValueError(f"{field} must hold numbers only (found {'booleans' if a.dtype.kind == 'b' else 'other values'})")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all():
            raise ValueError(f"{field} holds a value that is not finite (NaN or infinity) at index "
                             f"{int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])}")
        if integer and (a != np.round(a)).any():
            raise ValueError(f"{field} must hold whole numbers")
    bound = _INT_BOUND if integer else _FLOAT32_MAX
    beyond = (a > bound) | (a < -bound)
    if beyond.any():
        raise ValueError(f"{field} holds a value beyond {bound:.3g} (at index {_first(beyond.reshape(-1))})")
    return a.astype(np.int64 if integer else np.float32, copy=False)


def _int(value: Any, field: str, lo: int = 0, hi: int = _INT_BOUND) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be a whole number, got {_type_name(value)} {value!r:.40}")
    if not lo <= value <= hi:
        raise ValueError(f"{field} must lie in [{lo}, {hi}], got {value}")
    return value


def _strings(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{field} must be a list of strings")
    return list(value)


def _dict(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object, got {_type_name(value)}")
    return value


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_arrays(a: dict[str, np.ndarray], n_layers: int, logit_labels: list[str], str_tokens: list[str],
                 where: str) -> None:
    """The consistency of a graph's fields (numpy arrays of the right dtypes): what every reader and
    ``save`` check, so that a graph that loads is one every method of ``Graph`` can answer for."""
    n = len(a["kind"])
    for name in _NODE_FIELDS:
        if len(a[name]) != n:
            raise ValueError(f"{where}: {name} has {len(a[name])} entries, kind has {n} (one per node)")
    kind, layer, pos, feature = a["kind"], a["layer"], a["pos"], a["feature"]
    if n and ((kind < 0) | (kind > 3)).any():
        raise ValueError(f"{where}: kind[{_first((kind < 0) | (kind > 3))}] must be 0-3 (feature, error, token, logit)")
    P = len(a["tokens"])
    if len(str_tokens) != P:
        raise ValueError(f"{where}: str_tokens has {len(str_tokens)} entries, tokens has {P}")
    if (a["tokens"] < -1).any():
        raise ValueError(f"{where}: tokens[{_first(a['tokens'] < -1)}] must be a token id (or -1: not recorded)")
    bad = (pos < 0) | (pos >= P)
    if bad.any():
        raise ValueError(f"{where}: pos[{_first(bad)}] = {int(pos[_first(bad)])} is outside the prompt's {P} positions")
    inner = (kind == 0) | (kind == 1)
    expected = np.where(kind == 2, -1, np.where(kind == 3, n_layers, layer))
    bad = (layer != expected) | (inner & ((layer < 0) | (layer >= n_layers)))
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: layer[{i}] = {int(layer[i])} does not fit a {('feature', 'error', 'token', 'logit')[kind[i]]} "
                         f"node of a {n_layers}-layer model (features and errors 0..{n_layers - 1}, tokens -1, "
                         f"logits {n_layers})")
    bad = ((kind == 0) & (feature < 0)) | ((kind == 1) & (feature != -1)) | ((kind >= 2) & (feature < -1))
    tok = kind == 2
    if tok.any():
        recorded = a["tokens"][pos[tok]]
        mismatch = np.zeros(n, dtype=bool)
        mismatch[tok] = (recorded >= 0) & (recorded != feature[tok])
        bad |= mismatch
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{where}: feature[{i}] = {int(feature[i])} does not fit its "
                         f"{('feature', 'error', 'token', 'logit')[kind[i]]} node (a token node's is the token id)")
    keys = np.stack([kind, layer, pos, feature], axis=1)[kind != 3]
    if len(keys) and len(np.unique(keys, axis=0)) != len(keys):
        raise ValueError(f"{where}: a node appears twice (the same kind, layer, position and feature)")
    w = a["logit_weight"]
    bad = (w < 0) | (w > 1) | ((kind != 3) & (w != 0))
    if bad.any():
        raise ValueError(f"{where}: logit_weight[{_first(bad)}] = {float(w[_first(bad)])} must lie in [0, 1] for a "
                         "logit and be 0 for any other node")
    n_logits = int((kind == 3).sum())
    if len(logit_labels) != n_logits:
        raise ValueError(f"{where}: logit_labels has {len(logit_labels)} entries for {n_logits} logit nodes")
    t, s, ew = a["edge_target"], a["edge_source"], a["edge_weight"]
    if not len(t) == len(s) == len(ew):
        raise ValueError(f"{where}: edge_target, edge_source and edge_weight have {len(t)}, {len(s)} and {len(ew)} "
                         "entries (one per edge)")
    if not len(t):
        return
    for name, idx in (("edge_target", t), ("edge_source", s)):
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            raise ValueError(f"{where}: {name}[{_first(bad)}] = {int(idx[_first(bad)])} is not a node (there are {n})")
    kt, ks = kind[t], kind[s]
    bad = ~((kt == 0) | (kt == 3))
    if bad.any():
        raise ValueError(f"{where}: edge {_first(bad)} goes into a {('feature', 'error', 'token', 'logit')[kt[_first(bad)]]} "
                         "node; only features and logits have incoming edges")
    bad = ks == 3
    if bad.any():
        raise ValueError(f"{where}: edge {_first(bad)} comes out of a logit node; logits have no outgoing edges")
    bad = ((kt == 0) & (layer[s] >= layer[t])) | (pos[s] > pos[t])
    if bad.any():
        raise ValueError(f"{where}: edge {_first(bad)} goes from layer {int(layer[s][_first(bad)])}, position "
                         f"{int(pos[s][_first(bad)])} to layer {int(layer[t][_first(bad)])}, position "
                         f"{int(pos[t][_first(bad)])}: an edge goes to a later layer at the same or a later position")
    pair = t.astype(np.int64) * n + s.astype(np.int64)
    if len(np.unique(pair)) != len(pair):
        raise ValueError(f"{where}: an edge (target, source) appears twice")


# ---- our format --------------------------------------------------------------------------------------------
def graph_fields(d: Any, where: str = "the graph", own: bool = False) -> dict:
    """The keyword arguments of ``Graph(...)`` for a dict of ``Graph.to_dict``'s form, checked
    (``own``: ``d`` is the reader's to empty as it goes)."""
    d = _dict(d, where)
    if d.get("format") != GRAPH_FORMAT:
        raise ValueError(f"{where} is not a workbench attribution graph file (no \"format\": \"{GRAPH_FORMAT}\"; for "
                         "circuit-tracer's JSON use Graph.from_circuit_tracer)")
    if d.get("version", GRAPH_VERSION) != GRAPH_VERSION or isinstance(d.get("version"), bool):
        raise ValueError(f"{where}: version {d.get('version')!r} is not one this workbench reads ({GRAPH_VERSION})")
    missing = [k for k in (*_INT_FIELDS, *_FLOAT_FIELDS, "logit_labels", "str_tokens", "n_layers") if k not in d]
    if missing:
        raise ValueError(f"{where} is incomplete: it has no {', '.join(missing)}")
    arrays = {}
    for k in (*_INT_FIELDS, *_FLOAT_FIELDS):
        arrays[k] = _array(d[k], f"{where}: {k}", k in _INT_FIELDS)
        if own:  # a list of numbers takes about 32 bytes a number: let each go once it is an array
            d[k] = None
    n_layers = _int(d["n_layers"], f"{where}: n_layers", 0, 2**20)
    labels = _strings(d["logit_labels"], f"{where}: logit_labels")
    str_tokens = _strings(d["str_tokens"], f"{where}: str_tokens")
    check_arrays(arrays, n_layers, labels, str_tokens, where)
    vectors = None
    if d.get("logit_vectors") is not None:
        v = _array(d["logit_vectors"], f"{where}: logit_vectors", False, ndim=2)
        if len(v) != len(labels) or (len(v) and v.shape[1] == 0):
            raise ValueError(f"{where}: logit_vectors has shape {list(v.shape)}, not one row per logit node "
                             f"({len(labels)})")
        vectors = torch.from_numpy(v)
    meta = d.get("meta", {})
    meta = {} if meta is None else _dict(meta, f"{where}: meta")
    _check_depth(meta, f"{where}: meta")  # unknown keys are kept as they are
    return dict(**{k: torch.from_numpy(v) for k, v in arrays.items()}, logit_labels=labels, str_tokens=str_tokens,
                n_layers=n_layers, logit_vectors=vectors, meta=meta, qk=_qk_frame(d.get("qk"), where))


def _qk_frame(qk: Any, where: str):
    if qk is None:
        return None
    import pandas as pd

    qk = _dict(qk, f"{where}: qk")
    columns = _strings(qk.get("columns"), f"{where}: qk.columns")
    if len(set(columns)) != len(columns):
        raise ValueError(f"{where}: qk.columns names a column twice")
    rows = qk.get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: qk.rows must be a list of rows")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(columns):
            raise ValueError(f"{where}: qk.rows[{i}] must be a list of {len(columns)} values (one per column)")
        for x in row:
            if not (x is None or isinstance(x, (str, int, float))):
                raise ValueError(f"{where}: qk.rows[{i}] holds a {_type_name(x)}; a cell is a number, text or null")
    try:
        frame = pd.DataFrame(rows, columns=columns).infer_objects()
        if "pattern_change" in frame.columns:
            frame["pattern_change"] = frame["pattern_change"].astype(float)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{where}: qk is not a valid table ({e})") from None
    return frame


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a file ``save`` wrote (it begins as every one of them does)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_OUR_MARK)) == _OUR_MARK
    except OSError:
        return False


def save_graph(graph, path: Union[str, Path], overwrite: bool = False) -> Path:
    """Write ``graph.to_dict()`` to ``path`` atomically, after checking it would load again."""
    from workbench.utils import check_path

    path = check_path(path, "graph file path")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the graph file's path (e.g. {path / 'graph.json'})")
    if (path.exists() or path.is_symlink()) and not overwrite and not (path.is_file() and is_ours(path)):
        raise ValueError(f"{path} exists and is not a graph file this workbench saved; pass overwrite=True to "
                         "replace it, or choose another name")
    d = graph.to_dict()
    graph_fields(d, "the graph to save")  # a file that would not load again is not written
    _write_atomic(path, json.dumps(d))  # meta is kept as given: a NaN in it is written as json writes one
    return path


def load_graph(path: Union[str, Path], max_bytes: Optional[int] = DEFAULT_MAX_BYTES) -> dict:
    return graph_fields(read_json(path, max_bytes), f"the graph file {path}", own=True)


# ---- circuit-tracer's format -------------------------------------------------------------------------------
def _ct_int(node: dict, key: str, where: str, lo: int = -1) -> int:
    return _int(node.get(key), f"{where}.{key}", lo)


def circuit_tracer_fields(d: Any, where: str = "the circuit-tracer graph") -> dict:
    """``Graph(...)``'s keyword arguments for circuit-tracer's graph JSON (its pruned nodes and links), checked."""
    d = _dict(d, where)
    for key in ("metadata", "nodes", "links"):
        if key not in d:
            raise ValueError(f"{where} is not a circuit-tracer graph file: it has no {key!r}")
    meta = _dict(d["metadata"], f"{where}: metadata")
    prompt_tokens = _strings(meta.get("prompt_tokens"), f"{where}: metadata.prompt_tokens")
    slug = meta.get("slug", "")
    if not isinstance(slug, str):
        raise ValueError(f"{where}: metadata.slug must be a string")
    nodes, links = d["nodes"], d["links"]
    if not isinstance(nodes, list) or not isinstance(links, list):
        raise ValueError(f"{where}: nodes and links must be lists")
    rows, ids, labels = [], [], []
    logit_layers, inner_layers = set(), [-1]
    for i, n in enumerate(nodes):
        at = f"{where}: nodes[{i}]"
        n = _dict(n, at)
        node_id, ftype = n.get("node_id"), n.get("feature_type")
        if not isinstance(node_id, str) or not isinstance(ftype, str):
            raise ValueError(f"{at}: node_id and feature_type must be strings")
        k = _CT_KINDS.get(ftype)
        if k is None:
            raise ValueError(f"{at}.feature_type: unknown circuit-tracer node type {ftype!r}")
        p = _ct_int(n, "ctx_idx", at, 0)
        if k in (0, 1, 3):
            layer_text = n.get("layer")
            if not isinstance(layer_text, str) or not layer_text.isdigit() or len(layer_text) > 7:
                raise ValueError(f"{at}.layer must be a layer number as a string, got {layer_text!r:.40}")
            layer = int(layer_text)
        if k == 0:
            parts = node_id.split("_")
            if len(parts) != 3 or not all(x.isdigit() and len(x) < 16 for x in parts):
                raise ValueError(f"{at}.node_id {node_id!r:.60} is not a feature id (\"layer_feature_position\")")
            if int(parts[0]) != layer or int(parts[2]) != p:
                raise ValueError(f"{at}.node_id {node_id!r} disagrees with its layer {layer} or ctx_idx {p}")
            activation = n.get("activation")
            if activation is not None and (isinstance(activation, bool) or not isinstance(activation, (int, float))):
                raise ValueError(f"{at}.activation must be a number or null")
            rows.append((0, layer, p, int(parts[1]), float(activation or 0.0), 0.0))
            inner_layers.append(layer)
        elif k == 1:
            rows.append((1, layer, p, -1, 0.0, 0.0))
            inner_layers.append(layer)
        elif k == 2:
            parts = node_id.split("_")
            if len(parts) != 3 or parts[0] != "E" or not all(x.isdigit() and len(x) < 16 for x in parts[1:]) \
                    or int(parts[2]) != p:
                raise ValueError(f"{at}.node_id {node_id!r:.60} is not a token id (\"E_vocab_position\") at ctx_idx {p}")
            rows.append((2, -1, p, int(parts[1]), 0.0, 0.0))
        else:
            v = _ct_int(n, "feature", at)
            prob = n.get("token_prob", 0.0)
            if isinstance(prob, bool) or not isinstance(prob, (int, float)):
                raise ValueError(f"{at}.token_prob must be a number")
            clerp = n.get("clerp", "")
            if not isinstance(clerp, str):
                raise ValueError(f"{at}.clerp must be a string")
            rows.append((3, -2, p, v, 0.0, float(prob)))
            labels.append(clerp.split('"')[1] if clerp.count('"') >= 2 else str(v))
            logit_layers.add(layer)
        ids.append(node_id)
    if len(logit_layers) > 1:
        raise ValueError(f"{where}: the logit nodes name different layers ({sorted(logit_layers)})")
    n_layers = max(max(inner_layers) + 1, (min(logit_layers) - 1) if logit_layers else 0)
    if len(set(ids)) != len(ids):
        seen: set = set()
        twice = next(x for x in ids if x in seen or seen.add(x))
        raise ValueError(f"{where}: node_id {twice!r} names two nodes (circuit-tracer's error ids \"0_layer_position\" "
                         "can equal a layer-0 feature's id; the links cannot say which is meant)")
    order = sorted(range(len(rows)), key=lambda i: (rows[i][0], rows[i][1] if rows[i][0] != 3 else 0, rows[i][2],
                                                    rows[i][3], i))
    where_id = {ids[i]: j for j, i in enumerate(order)}
    t, s, w = [], [], []
    for i, link in enumerate(links):
        at = f"{where}: links[{i}]"
        link = _dict(link, at)
        src, tgt, weight = link.get("source"), link.get("target"), link.get("weight")
        if not isinstance(src, str) or not isinstance(tgt, str):
            raise ValueError(f"{at}: source and target must be node ids (strings)")
        for end, node_id in (("source", src), ("target", tgt)):
            if node_id not in where_id:
                raise ValueError(f"{at}.{end} {node_id!r:.60} is not a node of this file")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{at}.weight must be a number")
        t.append(where_id[tgt]), s.append(where_id[src]), w.append(weight)
    rows_sorted = [rows[i] for i in order]
    cols = [list(c) for c in zip(*rows_sorted)] if rows_sorted else [[] for _ in range(6)]
    cols[1] = [n_layers if k == 3 else layer for k, layer in zip(cols[0], cols[1])]
    P = len(prompt_tokens)
    tokens = np.full(P, -1, dtype=np.int64)
    for k, _, p, f, _, _ in rows_sorted:
        if k == 2 and p < P:
            tokens[p] = f
    arrays = {"kind": _array(cols[0], f"{where}: feature_type", True), "layer": _array(cols[1], f"{where}: layer", True),
              "pos": _array(cols[2], f"{where}: ctx_idx", True), "feature": _array(cols[3], f"{where}: feature", True),
              "activation": _array(cols[4], f"{where}: activation", False),
              "logit_weight": _array(cols[5], f"{where}: token_prob", False),
              "edge_target": _array(t, f"{where}: links.target", True),
              "edge_source": _array(s, f"{where}: links.source", True),
              "edge_weight": _array(w, f"{where}: links.weight", False), "tokens": tokens}
    logit_order = [i for i in order if rows[i][0] == 3]
    label_of = dict(zip([i for i in range(len(rows)) if rows[i][0] == 3], labels))
    logit_labels = [label_of[i] for i in logit_order]
    check_arrays(arrays, n_layers, logit_labels, prompt_tokens, where)
    return dict(**{k: torch.from_numpy(v) for k, v in arrays.items()}, logit_labels=logit_labels,
                str_tokens=list(prompt_tokens), n_layers=n_layers, meta={"from": "circuit-tracer", "slug": slug})


def load_circuit_tracer(source: Union[str, Path, dict], max_bytes: Optional[int] = DEFAULT_MAX_BYTES) -> dict:
    if isinstance(source, dict):
        _check_depth(source, "the circuit-tracer graph")
        return circuit_tracer_fields(source)
    return circuit_tracer_fields(read_json(source, max_bytes, "circuit-tracer graph file"),
                                 f"the circuit-tracer graph file {source}")


def check_slug(slug: Any) -> str:
    """``slug`` when it names one file ``{slug}.json`` inside the folder and not the folder's listing."""
    if not isinstance(slug, str) or not slug.strip():
        raise ValueError(f"slug must be a non-empty string, got {slug!r:.60}")
    bad = [c for c in ("/", "\\", "\x00", os.sep, os.altsep or "/") if c in slug]
    if bad or ".." in slug or slug.startswith("."):
        raise ValueError(f"slug {slug!r:.60} must be a plain name: no path separators, no '..', no leading '.' (the "
                         "graph is written to <folder>/<slug>.json)")
    if f"{slug}.json".casefold() == LISTING.casefold():
        raise ValueError(f"slug {slug!r} would write over the folder's listing {LISTING}; choose another slug")
    if len(f"{slug}.json".encode("utf-8", "surrogateescape")) > 255:
        raise ValueError(f"slug {slug[:40]!r}... is too long for a file name (at most 250 bytes)")
    return slug


def _read_listing(index: Path) -> dict:
    listing = read_json(index, DEFAULT_MAX_BYTES, "graph listing")
    if not isinstance(listing, dict) or not isinstance(listing.get("graphs"), list) or not all(
            isinstance(g, dict) and isinstance(g.get("slug"), str) for g in listing["graphs"]):
        raise ValueError(f"the graph listing {index} is damaged (not {{\"graphs\": [{{\"slug\": ...}}, ...]}}); "
                         "repair or remove it; nothing was written")
    return listing


def _previous_export(path: Path, slug: str, listing: dict) -> bool:
    """Whether ``path`` is this folder's export of ``slug``: listed, and a graph file naming that slug."""
    if not path.is_file() or path.is_symlink() or slug not in {g["slug"] for g in listing["graphs"]}:
        return False
    try:
        d = read_json(path, DEFAULT_MAX_BYTES)
    except ValueError:
        return False
    return isinstance(d, dict) and isinstance(d.get("metadata"), dict) and d["metadata"].get("slug") == slug \
        and isinstance(d.get("nodes"), list)


def write_circuit_tracer(d: dict, folder: Union[str, Path], overwrite: bool = False) -> Path:
    """Write circuit-tracer's graph dict ``d`` as ``{folder}/{slug}.json`` and list it in ``{folder}/graph-metadata.json``."""
    from workbench.utils import check_path

    slug = check_slug(d["metadata"]["slug"])
    folder = check_path(folder, "export folder")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder; give the folder to export into")
    index, path = folder / LISTING, folder / f"{slug}.json"
    try:
        text = json.dumps(d, indent=2, allow_nan=False)  # the viewers read standard JSON
    except ValueError:
        raise ValueError(f"the graph {slug!r} holds a value that is not finite (NaN or infinity); circuit-tracer's "
                         "format cannot hold it: nothing was written") from None
    from workbench.checkpoint import locked

    # two exports into one folder read, change and replace one listing: under its lock (a transient
    # .graph-metadata.json.lock inside the folder), so that neither drops the other's entry
    with locked(index):
        listing = _read_listing(index) if index.exists() or index.is_symlink() else {"graphs": []}
        if path.is_dir():
            raise ValueError(f"{path} is a folder; choose another slug")
        if (path.exists() or path.is_symlink()) and not overwrite and not _previous_export(path, slug, listing):
            raise ValueError(f"{path} exists and is not this folder's export of {slug!r}; pass overwrite=True to "
                             "replace it, or choose another slug")
        _write_atomic(path, text)
        listing["graphs"] = [g for g in listing["graphs"] if g["slug"] != slug] + [d["metadata"]]
        _write_atomic(index, json.dumps(listing, indent=2))
    return path


def _write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` by a temporary file beside it and a rename (a function, not text, to
    ``write_atomic``: a new file too): a reader sees the old file or the new one, never half of one; a
    link at ``path`` is replaced, not followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
