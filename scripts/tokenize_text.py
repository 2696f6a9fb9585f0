#!/usr/bin/python3
"""Your own text as token data for a ddp_train sequence model, with its vocabulary in the file.

usage: tokenize_text.py [--tokenizer gpt2 --vocab vocab.json --merges merges.txt | --tokenizer bytes]
                        [--text-field text] [--val-every 20] INPUT [INPUT ...] OUT.h5

- INPUT: text files, directories (every regular file under them, in name order), or JSON-lines files
  (.jsonl: one JSON object a line, its --text-field a document). A text file is one document.
- --tokenizer gpt2: GPT-2's byte-level BPE through Hugging Face `tokenizers`, from a vocab.json and a
  merges.txt (GPT-2's own: the `gpt2` model's files on the Hugging Face hub, fetched on a machine with
  internet, e.g. `huggingface_hub.hf_hub_download("gpt2", "vocab.json")`; or a vocabulary trained with
  `tokenizers.ByteLevelBPETokenizer`). Documents are joined with its <|endoftext|>.
- --tokenizer bytes: each byte a token (vocab 256), documents joined with a newline.
- Every --val-every-th document (the last of each group) goes to validation, the rest to training.
- OUT.h5: /train/tokens and /val/tokens, flat streams (L,) of uint16 ids (int32 past 65,536), which
  ddp_train cuts into windows of model.input + 1 tokens; and the vocabulary, so that `ddp_train --sample`
  prints text and encodes --prompt as the library does:
    /vocab/bytes (uint8) and /vocab/offsets (V+1, int64): token i is bytes[offsets[i]:offsets[i+1]]
    /vocab/merges (M, 2) int32: the BPE merges by rank, as the ids of the two tokens joined
    /vocab/special (V,) uint8: 1 for special tokens (<|endoftext|>), matched whole in a prompt
    /vocab attributes: tokenizer ("gpt2" or "bytes"), eot (the end-of-text id, -1 for bytes)
- Written under a temporary name, then renamed.
"""
import argparse
import json
import os
import sys

import h5py
import numpy as np


def byte_alphabet():
    """GPT-2's printable stand-ins for bytes in vocab.json and merges.txt: byte b -> one character.
    Printable Latin-1 bytes stand for themselves; the other 68 take the code points from 256 on, in
    byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def documents(inputs, field):
    """Each document's text, in order."""
    for path in inputs:
        if os.path.isdir(path):
            names = []
            for root, dirs, files in os.walk(path):
                dirs.sort()
                names += [os.path.join(root, f) for f in sorted(files)]
            yield from documents([n for n in names if os.path.isfile(n) and not os.path.islink(n)], field)
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        obj = json.loads(line)
                        if field not in obj:
                            sys.exit(f"tokenize_text.py: {path}:{n}: no '{field}' field (--text-field)")
                        yield obj[field]
        else:
            with open(path, encoding="utf-8", errors="strict") as f:
                yield f.read()


class Gpt2:
    def __init__(self, vocab_path, merges_path):
        from tokenizers import ByteLevelBPETokenizer
        self.tok = ByteLevelBPETokenizer(vocab_path, merges_path)
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        self.special = [s for s in ("<|endoftext|>",) if s in vocab]
        if not self.special:
            sys.exit(f"tokenize_text.py: {vocab_path} has no <|endoftext|> token to join documents with")
        self.tok.add_special_tokens(self.special)
        self.eot = vocab["<|endoftext|>"]
        to_byte = {c: b for b, c in byte_alphabet().items()}
        self.table = [b""] * len(vocab)
        self.is_special = np.zeros(len(vocab), np.uint8)
        for s, i in vocab.items():
            if s in self.special:
                self.table[i], self.is_special[i] = s.encode(), 1
            else:
                self.table[i] = bytes(to_byte[c] for c in s)
        with open(merges_path, encoding="utf-8") as f:
            lines = [l.rstrip("\n") for l in f if l.strip() and not l.startswith("#version")]
        self.merges = np.array([[vocab[a], vocab[b]] for a, b in (l.split(" ") for l in lines)], np.int32)
        self.name = "gpt2"

    def encode(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts)]


class Bytes:
    def __init__(self):
        self.table = [bytes([b]) for b in range(256)]
        self.is_special = np.zeros(256, np.uint8)
        self.merges = np.zeros((0, 2), np.int32)
        self.eot = -1
        self.name = "bytes"

    def encode(self, texts):
        return [list(t.encode("utf-8")) for t in texts]


def join(ids_lists, sep):
    out = []
    for ids in ids_lists:
        out += ids + sep
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", choices=["gpt2", "bytes"], default="gpt2")
    ap.add_argument("--vocab", help="vocab.json (--tokenizer gpt2)")
    ap.add_argument("--merges", help="merges.txt (--tokenizer gpt2)")
    ap.add_argument("--text-field", default="text", help="the text of a JSON-lines object (default: text)")
    ap.add_argument("--val-every", type=int, default=20, help="every N-th document to validation (default 20)")
    ap.add_argument("paths", nargs="+", metavar="INPUT... OUT.h5")
    a = ap.parse_args()
    if len(a.paths) < 2:
        ap.error("give at least one INPUT and the OUT.h5")
    *inputs, out = a.paths
    for p in inputs:
        if not os.path.exists(p):
            sys.exit(f"tokenize_text.py: {p} does not exist")
    if a.tokenizer == "gpt2":
        if not a.vocab or not a.merges:
            ap.error("--tokenizer gpt2 needs --vocab vocab.json and --merges merges.txt (see --help)")
        tok = Gpt2(a.vocab, a.merges)
    else:
        tok = Bytes()
    docs = list(documents(inputs, a.text_field))
    if len(docs) < 2:
        sys.exit("tokenize_text.py: fewer than 2 documents: nothing to split into training and validation")
    ids = tok.encode(docs)
    sep = [tok.eot] if tok.eot >= 0 else [ord("\n")]
    is_val = [i % a.val_every == a.val_every - 1 for i in range(len(docs))]
    if not any(is_val):
        is_val[-1] = True
    train = join([x for x, v in zip(ids, is_val) if not v], sep)
    val = join([x for x, v in zip(ids, is_val) if v], sep)
    dtype = np.uint16 if len(tok.table) <= 65536 else np.int32
    offsets = np.zeros(len(tok.table) + 1, np.int64)
    offsets[1:] = np.cumsum([len(b) for b in tok.table])
    tmp = f"{out}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    with h5py.File(tmp, "w") as f:
        f["train/tokens"] = np.array(train, dtype)
        f["val/tokens"] = np.array(val, dtype)
        g = f.create_group("vocab")
        g["bytes"] = np.frombuffer(b"".join(tok.table), np.uint8)
        g["offsets"] = offsets
        g["merges"] = tok.merges
        g["special"] = tok.is_special
        g.attrs["tokenizer"] = tok.name
        g.attrs["eot"] = tok.eot
    os.replace(tmp, out)
    print(f"{out}: {len(docs)} documents, train {len(train)} tokens, val {len(val)} tokens, vocab "
          f"{len(tok.table)} ({tok.name}), {np.dtype(dtype).name}")


if __name__ == "__main__":
    main()
