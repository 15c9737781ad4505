"""Speed of an imported GPT-2-shaped model: ours against plain Hugging Face and TransformerBridge.

One HF GPT-2 (d_model 256, 4 layers, 8 heads, d_mlp 1024, vocab 4096, ctx 256, random weights)
is imported with ``wb.from_hf`` and wrapped by TransformerLens' ``TransformerBridge``; the
contenders run interleaved in one process so machine noise hits them alike, and every time is
printed as a ratio to the plain HF forward (sdpa attention, HF's default):

    ours forward               target <= 1.15x HF
    ours run_with_cache        (every hook cached)
    bridge forward / run_with_cache   (the bridge forces eager attention, so HF eager is listed too)

    python benchmarks/interop.py [--repeats 7] [--batch 8] [--pos 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402


def build(directory: Path):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_inner=1024, vocab_size=4096,
                                     n_positions=256, bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    _word_tokenizer().save_pretrained(directory)  # the bridge wants a tokenizer; a local one
    load = lambda **kw: transformers.AutoModelForCausalLM.from_pretrained(directory, **kw).eval()  # noqa: E731
    return load(), load(attn_implementation="eager"), load(), wb.from_hf(directory)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4096)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pos", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    with tempfile.TemporaryDirectory() as tmp:
        hf_sdpa, hf_eager, hf_for_bridge, ours = build(Path(tmp))
        bridge = TransformerBridge.boot_transformers(
            tmp, hf_model=hf_for_bridge, tokenizer=AutoTokenizer.from_pretrained(tmp), device="cpu"
        )
    tokens = torch.randint(0, 4096, (args.batch, args.pos))
    contenders = {
        "hf forward (sdpa)": lambda: hf_sdpa(tokens).logits,
        "hf forward (eager)": lambda: hf_eager(tokens).logits,
        "ours forward": lambda: ours(tokens),
        "ours run_with_cache": lambda: ours.run_with_cache(tokens),
        "bridge forward": lambda: bridge(tokens),
        "bridge run_with_cache": lambda: bridge.run_with_cache(tokens),
    }
    with torch.no_grad():
        reference = hf_sdpa(tokens).logits
        diffs = {"ours forward": (ours(tokens) - reference).abs().max().item(),
                 "bridge forward": (bridge(tokens) - reference).abs().max().item()}
        # the first round was a warm-up, dropped from the medians
        times = interleaved(contenders, max(1, args.repeats - 1), warmup=args.repeats > 1)
    base = times["hf forward (sdpa)"]
    rows = []
    for name, median in times.items():
        rows.append({"contender": name, "median_s": median, "ratio_to_hf": median / base,
                     "tokens_per_s": args.batch * args.pos / median, "max_abs_logit_diff": diffs.get(name)})
    table = pd.DataFrame(rows)
    with pd.option_context("display.float_format", "{:.4g}".format, "display.width", 120):
        print(f"GPT-2 shape d256 x4 layers, batch {args.batch} x {args.pos} tokens, {args.repeats} repeats, "
              f"{args.threads} threads")
        print(table.to_string(index=False))
    ratio = table.set_index("contender").loc["ours forward", "ratio_to_hf"]
    print(f"ours forward / hf forward = {ratio:.2f}x (target <= 1.15x): {'ok' if ratio <= 1.15 else 'MISSED'}")
    return table


if __name__ == "__main__":
    main()
