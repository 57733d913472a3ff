"""How much of a corpus model.doc_mask changes: for each split and sequence length, the windows the
loader reads (training: windows of seq_len + 1 tokens, seq_len apart from each shard's start, as the
shuffle order cuts them at offset 0; validation: data.val_batches' windows) and how many of them hold
a document start (BOS) after their first position, so that within-document attention hides part of
the window from some tokens; and the share of input tokens that sit after such a BOS (the tokens
whose attention it restricts).

    python -m tools.doc_windows --config configs/cpu.yaml --seq-lens 128 256 1024 [key.sub=value ...]
"""

import argparse

import numpy as np

import data
import train
from config import load_config


def crossing(tokens: np.ndarray, seq_len: int, bos: int) -> tuple:
    """tokens: one shard or the concatenated validation split -> (windows, windows with a BOS at an
    input position >= 1, input tokens after such a BOS)."""
    n = (len(tokens) - 1) // seq_len
    inputs = tokens[:n * seq_len].reshape(n, seq_len) == bos
    inputs[:, 0] = False  # a window that starts with its document's BOS sees one document
    after = np.cumsum(inputs, axis=1) > 0
    return n, int(inputs.any(axis=1).sum()), int(after.sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256, 1024])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    train_files, val_files, tokenizer, fingerprint = train.open_data(cfg)
    bos = data.ByteTable(tokenizer).bos_id
    splits = {"train": [data.load_shard(f, cfg.model.vocab_size) for f in train_files],
              "val": [np.concatenate([data.load_shard(f, cfg.model.vocab_size) for f in val_files])]}
    print(f"data:{fingerprint} bos:{bos} documents: train {sum(int((s == bos).sum()) for s in splits['train'])} "
          f"val {int((splits['val'][0] == bos).sum())}")
    for split, shards in splits.items():
        for seq_len in args.seq_lens:
            n, crossed, after = map(sum, zip(*(crossing(s, seq_len, bos) for s in shards)))
            print(f"{split} seq_len:{seq_len} windows:{n} crossing:{crossed} ({crossed / n:.1%}) "
                  f"tokens_after_a_start:{after / (n * seq_len):.1%}")


if __name__ == "__main__":
    main()
