#!/usr/bin/python3
"""Byte-level token data for sequence models from Debian's `fortunes` package (English fortune
cookies, about 2.5 MB): data/fortunes.h5 with /train/tokens and /val/tokens, (N, T+1) uint8.

usage: make_text_data.py [SRC_DIR [OUT.h5]]   (default /usr/share/games/fortunes data/fortunes.h5;
                                               written under a temporary name, then renamed)

- Tokens are the bytes of the files (vocab 256), so no tokenizer is needed.
- Files: every regular file of SRC_DIR except the .dat indexes; the .u8 names are symbolic links to
  the same files and subdirectories (translations, the offensive set of fortunes-off) are skipped.
- Split: each file is cut into its fortunes (the text between lines holding a single `%`); every
  20th fortune of a file (the 20th, 40th...) goes to validation (5%), the rest to training. Each
  split is the concatenation, in file-name order, of its fortunes, each followed by "%\\n" as in the
  source files, so the model also learns where a fortune ends.
- Rows: windows of T+1 = 129 bytes with a stride of T = 128, so each byte after the first is a
  target exactly once (input row[0:T], targets row[1:T+1]); the last (< T) bytes are dropped.
- The output depends only on the files: the same bytes on every run (no timestamps).
"""
import os
import subprocess
import sys

import h5py
import numpy as np

T = 128
VAL_EVERY = 20


def fortunes(data):
    """The fortunes of one file (bytes, without their `%` separator lines), empty ones dropped."""
    out, cur = [], []
    for line in data.split(b"\n"):
        if line == b"%":
            out.append(b"\n".join(cur))
            cur = []
        else:
            cur.append(line)
    out.append(b"\n".join(cur))
    return [f.strip(b"\n") for f in out if f.strip()]


def windows(stream):
    """(N, T+1) uint8 rows of `stream` with stride T."""
    a = np.frombuffer(stream, dtype=np.uint8)
    n = (len(a) - 1) // T
    idx = np.arange(n)[:, None] * T + np.arange(T + 1)[None, :]
    return a[idx]


def package_version():
    try:
        p = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "fortunes"], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def main():
    if len(sys.argv) > 3 or any(a.startswith("-") for a in sys.argv[1:]):
        sys.exit(__doc__)
    src = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/games/fortunes"
    out = sys.argv[2] if len(sys.argv) > 2 else "data/fortunes.h5"
    if not os.path.isdir(src):
        sys.exit(f"make_text_data.py: {src} does not exist: install Debian's fortunes package "
                 "(make deps does, as root)")
    names = sorted(n for n in os.listdir(src)
                   if not n.endswith(".dat") and not os.path.islink(os.path.join(src, n))
                   and os.path.isfile(os.path.join(src, n)))
    if not names:
        sys.exit(f"make_text_data.py: no fortune files in {src}")
    train, val = [], []
    counts = [0, 0]
    for name in names:
        with open(os.path.join(src, name), "rb") as f:
            for i, text in enumerate(fortunes(f.read())):
                is_val = i % VAL_EVERY == VAL_EVERY - 1
                (val if is_val else train).append(text + b"\n%\n")
                counts[is_val] += 1
    tmp = f"{out}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    with h5py.File(tmp, "w", track_order=False) as f:
        f.attrs["vocab"] = 256
        f.attrs["seq_len"] = T
        f.attrs["tokens"] = "bytes: token = byte value (vocab 256); rows (N, T+1): input row[0:T], targets row[1:T+1]"
        f.attrs["source"] = f"Debian package fortunes {package_version()}, {src}"
        f.attrs["files"] = " ".join(names)
        f.attrs["split"] = f"every {VAL_EVERY}th fortune of each file is validation"
        for split, parts, n_fortunes in (("train", train, counts[0]), ("val", val, counts[1])):
            stream = b"".join(parts)
            rows = windows(stream)
            if len(rows) == 0:
                sys.exit(f"make_text_data.py: {src}: too little text for one {split} row of {T + 1} bytes")
            ds = f.create_dataset(f"/{split}/tokens", data=rows, chunks=(min(1024, len(rows)), T + 1),
                                  track_times=False)
            ds.attrs["fortunes"] = n_fortunes
            ds.attrs["bytes"] = len(stream)
            print(f"{split}: {n_fortunes} fortunes, {len(stream)} bytes, {rows.shape[0]} rows of {T + 1} tokens")
    os.replace(tmp, out)
    print(f"wrote {out} ({len(names)} files from {src})")


if __name__ == "__main__":
    main()
