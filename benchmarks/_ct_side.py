"""circuit-tracer's side of benchmarks/graphs_ct.py: runs in circuit-tracer's own venv, never imports workbench.

    /work/ctvenv/bin/python benchmarks/_ct_side.py --exchange DIR --context 64 --out DIR/ct-64

Reads what graphs_ct.py exported into ``--exchange`` (``model.json``: the HookedTransformerConfig
fields; ``model.safetensors``: the weights under HookedTransformer's names; ``transcoders/``: the
transcoder set in circuit-tracer's own files; ``tokens.json``), builds
``ReplacementModel.from_config`` offline (a local WordLevel tokenizer), and writes into ``--out``:
``logits.safetensors`` (the model's logits on the prompt, for the weight-mapping check), and with
``--context`` > 0, ``graph.safetensors`` (the dense adjacency, active and selected features, logit
targets and probabilities, circuit-tracer's pruning masks at 0.8 / 0.98) and ``timing.json``
(seconds in ``attribute``, peak resident memory before and after).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


from _memory import peak_mb  # noqa: E402  (the benchmarks' folder is on sys.path: the script's own)


def tokenizer_dir(d_vocab: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tempfile.mkdtemp(prefix="ct-tok-")
    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(d_vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t3").save_pretrained(folder)
    return folder


def build(exchange: Path):
    from transformer_lens import HookedTransformerConfig

    from circuit_tracer import ReplacementModel
    from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
    from circuit_tracer.transcoder.activation_functions import TopK
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    spec = json.loads((exchange / "model.json").read_text())
    cfg = HookedTransformerConfig(**spec, tokenizer_name=tokenizer_dir(spec["d_vocab"]), init_weights=False,
                                  device="cpu", dtype=torch.float32)
    tc_dir = exchange / "transcoders"
    tc_cfg = json.loads((tc_dir / "config.yaml").read_text())  # JSON is YAML; its loader reads the same file
    paths = {i: p for i, p in enumerate(tc_cfg["transcoders"])}
    loaded = load_transcoder_set(paths, scan=tc_cfg["scan"], feature_input_hook=tc_cfg["feature_input_hook"],
                                 feature_output_hook=tc_cfg["feature_output_hook"], device=torch.device("cpu"),
                                 dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    if tc_cfg.get("activation") == "topk":  # its files hold no TopK: rebuild each with TopK(k), as its tests do
        transcoders = {}
        for i, t in enumerate(loaded):
            new = SingleLayerTranscoder(t.d_model, t.d_transcoder, TopK(int(tc_cfg["k"])), i,
                                        skip_connection=t.W_skip is not None, device=torch.device("cpu"),
                                        dtype=torch.float32)
            new.load_state_dict(t.state_dict())
            transcoders[i] = new
        loaded = TranscoderSet(transcoders, feature_input_hook=tc_cfg["feature_input_hook"],
                               feature_output_hook=tc_cfg["feature_output_hook"], scan=tc_cfg["scan"])
    model = ReplacementModel.from_config(cfg, loaded)
    weights = load_file(str(exchange / "model.safetensors"))
    own = model.state_dict()
    renamed = {}
    for name, value in weights.items():
        for candidate in (name, name.replace(".mlp.", ".mlp.old_mlp."), name.replace("unembed.", "unembed.old_unembed.")):
            if candidate in own:
                renamed[candidate] = value
                break
        else:
            sys.exit(f"exported weight {name} has no place in circuit-tracer's model")
    missing = [k for k in own if k not in renamed and not k.endswith(("mask", "IGNORE", "rotary_sin", "rotary_cos"))
               and not k.startswith("transcoders.")]
    if missing:
        sys.exit(f"circuit-tracer's model has weights the export lacks: {missing[:8]}")
    model.load_state_dict(renamed, strict=False)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--exchange", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context", type=int, default=0, help="prompt length for a graph (0: only the logits)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-feature-nodes", type=int, default=None, help="attribute's max_feature_nodes (None: all)")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("CT_THREADS", "1")))
    args.out.mkdir(parents=True, exist_ok=True)
    model = build(args.exchange)
    tokens = torch.tensor(json.loads((args.exchange / "tokens.json").read_text()))
    with torch.no_grad():
        save_file({"logits": model(tokens[None]).float()[0].contiguous()}, str(args.out / "logits.safetensors"))
    if not args.context:
        return
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores, prune_graph

    prompt = tokens[: args.context]
    before = peak_mb()
    start = time.perf_counter()
    graph = attribute(prompt, model, batch_size=args.batch_size, max_feature_nodes=args.max_feature_nodes,
                      verbose=False)
    seconds = time.perf_counter() - start
    after = peak_mb()
    pruned = prune_graph(graph, 0.8, 0.98)
    replacement, completeness = compute_graph_scores(graph)
    save_file({"adjacency": graph.adjacency_matrix.float().contiguous(),
               "active_features": graph.active_features.long().contiguous(),
               "selected_features": graph.selected_features.long().contiguous(),
               "activation_values": graph.activation_values.float().contiguous(),
               "logit_ids": torch.tensor([t.vocab_idx for t in graph.logit_targets], dtype=torch.long),
               "logit_probabilities": graph.logit_probabilities.float().contiguous(),
               "node_mask": pruned.node_mask.contiguous(), "edge_mask": pruned.edge_mask.contiguous()},
              str(args.out / "graph.safetensors"))
    import circuit_tracer

    (args.out / "timing.json").write_text(json.dumps({
        "context": args.context, "seconds": seconds, "peak_rss_mb_before": before, "peak_rss_mb": after,
        "n_nodes": int(graph.adjacency_matrix.shape[0]), "n_active_features": int(len(graph.active_features)),
        "threads": torch.get_num_threads(), "circuit_tracer": getattr(circuit_tracer, "__version__", "?"),
        "torch": torch.__version__, "scores": {"replacement": replacement, "completeness": completeness}}, indent=1))


if __name__ == "__main__":
    main()
