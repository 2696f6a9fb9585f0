"""Your own text through GPT-2's byte-level BPE, with no download: a small vocabulary trained here with
Hugging Face `tokenizers` (pinned in tests/requirements-hf.txt, `make pydeps`) on Debian's fortunes,
scripts/tokenize_text.py's data file, and the binary's own tokenizer (src/tokenizer.c, through
build/*/tests/tokenize_ids and `--sample`): its --prompt ids equal the library's on 240 strings (ASCII,
accents, emoji, numbers, runs of spaces, contractions, other scripts, the end-of-text token), and its
decoding gives back the exact text."""
import json
import os
import subprocess
import sys
import unittest

import h5py
import numpy as np

from helpers import ROOT, Workdir, errors, run

sys.path.append(os.path.join(ROOT, "build", "pydeps"))  # after Debian's packages: only what Debian lacks
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
try:
    from tokenizers import ByteLevelBPETokenizer
except ImportError:  # make pydeps could not reach PyPI
    ByteLevelBPETokenizer = None

FORTUNES = "/usr/share/games/fortunes"
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build/cuda"))
TOOL = os.path.join(BUILD, "tests", "tokenize_ids")
VOCAB = 1500

STRINGS = [
    "Hello world", "Hello  world", "  leading spaces", "trailing spaces   ", "a   b    c     d", "tab\there",
    "line1\nline2\n\n  indented\n", "\n\n\n", " ", "", "x", "café naïve résumé façade", "Ça va? Déjà vu!",
    "Straße groß Übermut", "emoji 🎉 party 👍🏽 ok", "🎉🎉🎉", "flags 🇫🇷🇩🇪", "3.14159 and 1,000,000 and 42nd",
    "2024-11-26 12:30:00", "x²+y³=z⁴ ½ ¾", "I'm we're they've she'll he'd it's don't", "'S 'T 'RE upper",
    "rock'n'roll o'clock", "Привет мир, как дела?", "日本語のテキストです。", "中文字符测试", "مرحبا بالعالم",
    "שלום עולם", "Γειά σου Κόσμε", "नमस्ते दुनिया", "한국어 텍스트", "mixed日本語and English",
    "end<|endoftext|>start", "<|endoftext|>", "a<|endoftext|><|endoftext|>b", "quotes \"double\" 'single'",
    "symbols !@#$%^&*()_+-=[]{}|;:,.<>/?`~", "...", "--- *** ===", "email: someone@example.com",
    "http://example.com/path?q=1&r=2", "C:\\path\\to\\file", "non\u00a0breaking\u2003spaces\u3000here",
    "zero\u200bwidth", "combining e\u0301 a\u0308", "ﬁ ligature", "Ⅻ roman ⑦ circled",
]


def fortune_lines(n):
    """n distinct non-empty lines of the fortunes, spread over the corpus."""
    with open(os.path.join(FORTUNES, "fortunes"), encoding="utf-8", errors="replace") as f:
        lines = [l.rstrip("\n") for l in f if l.strip() and l.strip() != "%"]
    lines = list(dict.fromkeys(lines))
    step = max(1, len(lines) // n)
    return lines[::step][:n]


def escape(s):
    return s.replace("\\", "\\\\").replace("\n", "\\n")


class Inputs(unittest.TestCase):
    def test_directories_and_json_lines_with_the_byte_tokenizer(self):
        """A directory (its files in name order, subdirectories too) and a .jsonl file, --tokenizer bytes:
        the documents joined with newlines, every second one to validation, the 256 bytes as the vocabulary."""
        w = Workdir()
        try:
            os.makedirs(w.file("docs/sub"))
            for name, text in (("b.txt", "second"), ("a.txt", "first"), ("sub/c.txt", "thïrd")):
                with open(w.file(f"docs/{name}"), "w", encoding="utf-8") as f:
                    f.write(text)
            with open(w.file("more.jsonl"), "w") as f:
                for t in ("fourth", "fifth"):
                    f.write(json.dumps({"body": t, "id": 1}) + "\n")
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tokenize_text.py"), "--tokenizer", "bytes",
                                "--text-field", "body", "--val-every", "2", w.file("docs"), w.file("more.jsonl"),
                                w.file("out.h5")], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with h5py.File(w.file("out.h5"), "r") as f:
                self.assertEqual(bytes(f["train/tokens"][...].astype(np.uint8)), "first\nthïrd\nfifth\n".encode())
                self.assertEqual(bytes(f["val/tokens"][...].astype(np.uint8)), b"second\nfourth\n")
                self.assertEqual(f["vocab"].attrs["tokenizer"], "bytes")
                self.assertEqual(bytes(f["vocab/bytes"][...]), bytes(range(256)))
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tokenize_text.py"), "--tokenizer", "bytes",
                                w.file("more.jsonl"), w.file("bad.h5")], capture_output=True, text=True)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("more.jsonl:1: no 'text' field (--text-field)", p.stderr)
        finally:
            w.cleanup()


    def test_the_unicode_classes_are_what_the_script_generates(self):
        w = Workdir()
        try:
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_unicode_classes.py"),
                                w.file("u.h")], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(w.file("u.h")) as a, open(os.path.join(ROOT, "src", "unicode_classes.h")) as b:
                self.assertEqual(a.read(), b.read(), "run scripts/gen_unicode_classes.py")
        finally:
            w.cleanup()


@unittest.skipIf(ByteLevelBPETokenizer is None, "no Hugging Face tokenizers (make pydeps)")
@unittest.skipIf(not os.path.isdir(FORTUNES), "no fortunes package (make deps installs it)")
class Gpt2Tokenizer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.w = Workdir()
        w = cls.w
        files = [os.path.join(FORTUNES, n) for n in ("fortunes", "science", "computers", "literature", "people")]
        tok = ByteLevelBPETokenizer()
        tok.train(files, vocab_size=VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
        os.makedirs(w.file("bpe"))
        tok.save_model(w.file("bpe"))
        cls.vocab, cls.merges = w.file("bpe/vocab.json"), w.file("bpe/merges.txt")
        cls.tok = ByteLevelBPETokenizer(cls.vocab, cls.merges)
        cls.tok.add_special_tokens(["<|endoftext|>"])
        cls.files = files
        p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tokenize_text.py"), "--vocab", cls.vocab,
                            "--merges", cls.merges, "--val-every", "3"] + files + [w.file("text.h5")],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "build",
                                                                                                       "pydeps")))
        if p.returncode:
            raise AssertionError(p.stdout + p.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.w.cleanup()

    def tool(self, mode, lines):
        """tokenize_ids' output (bytes) for lines (str)."""
        p = subprocess.run([TOOL, self.w.file("text.h5"), str(VOCAB), mode],
                           input="".join(l + "\n" for l in lines).encode("utf-8"), capture_output=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout

    def test_the_file_holds_the_documents_and_the_vocabulary(self):
        eot = self.tok.token_to_id("<|endoftext|>")
        docs = []
        for path in self.files:
            with open(path, encoding="utf-8") as f:
                docs.append(f.read())
        want_train, want_val = [], []
        for i, d in enumerate(docs):  # every third document to validation
            (want_val if i % 3 == 2 else want_train).extend(self.tok.encode(d).ids + [eot])
        with h5py.File(self.w.file("text.h5"), "r") as f:
            self.assertEqual(f["train/tokens"].dtype, np.uint16)
            np.testing.assert_array_equal(f["train/tokens"][...], want_train)
            np.testing.assert_array_equal(f["val/tokens"][...], want_val)
            self.assertEqual(f["vocab/offsets"].shape, (VOCAB + 1,))
            self.assertEqual(f["vocab"].attrs["tokenizer"], "gpt2")
            self.assertEqual(int(f["vocab"].attrs["eot"]), eot)

    def test_prompt_ids_equal_the_library_and_decode_to_the_text(self):
        strings = STRINGS + fortune_lines(240 - len(STRINGS))
        self.assertGreaterEqual(len(strings), 240)
        multibyte = [s for s in strings if any(ord(c) > 127 for c in s)]
        self.assertGreaterEqual(len(multibyte), 20)
        got = self.tool("encode", [escape(s) for s in strings]).decode().split("\n")[:-1]
        self.assertEqual(len(got), len(strings))
        for s, line in zip(strings, got):
            want = self.tok.encode(s).ids
            self.assertEqual([int(x) for x in line.split()], want, repr(s))
        decoded = self.tool("decode", [" ".join(map(str, self.tok.encode(s).ids)) for s in strings]).split(b"\0")
        for s, d in zip(strings, decoded):
            self.assertEqual(d, s.encode("utf-8"), repr(s))

    def test_text_that_cannot_be_encoded_exactly_is_refused(self):
        p = subprocess.run([TOOL, self.w.file("text.h5"), str(VOCAB), "encode"], input=b"ok \xff\xfe bytes\n",
                           capture_output=True)
        self.assertIn(b"error: --prompt: byte 3 is not UTF-8", p.stdout)
        # a vocabulary larger than the model's
        p = subprocess.run([TOOL, self.w.file("text.h5"), "1000", "encode"], input=b"x\n", capture_output=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn(b"/vocab has 1500 tokens but the model's vocabulary is 1000", p.stderr)

    def test_sample_prints_text(self):
        """A small GPT trained 20 steps on the file: --sample continues a prompt in text, the prompt
        encoded by the binary, and an invalid prompt is exit 2 on every rank with one message."""
        w = self.w
        cfg = w.config("""\
            model:
              input: [32]
              layers:
                - embedding: {{vocab: {vocab}, dim: 32, positions: true}}
                - residual: {{body: [layernorm: {{}}, attention: {{heads: 2, causal: true}}]}}
                - layernorm: {{}}
                - linear: {{out: {vocab}, bias: false, tie: "0"}}
            data: {{path: {dir}/text.h5, train: {{x: /train/tokens}}, val: {{x: /val/tokens}}}}
            train: {{epochs: 1, max_steps: 20, global_batch_size: 16, seed: 1}}
            optim: {{name: adamw, lr: 0.003}}
            log: {{dir: {dir}/log}}
            checkpoint: {{dir: {dir}/ckpt}}
            """, name="gpt.yaml", vocab=VOCAB)
        rc, out, err = run([cfg], np_=2, timeout=300)
        self.assertEqual(rc, 0, out + err)
        prompt = "Café au lait, the"
        rc, out, err = run([cfg, "--resume", "auto", "--sample", "12", "--prompt", prompt, "--temperature", "0"],
                           np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("\n" + prompt, out)  # after the line saying what it resumed
        continuation = out[out.index("\n" + prompt) + 1 + len(prompt):-1]  # and before the final newline
        self.assertGreater(len(continuation), 0)
        self.assertNotRegex(continuation, r"^( ?\d+){12}$")  # text, not ids
        rc, out, err = run([cfg, "--resume", "auto", "--sample", "3", "--prompt", "bad \udcff"], np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertEqual(len(errors(err)), 1, err)
        self.assertIn("is not UTF-8", errors(err)[0])

    def test_the_whole_path_on_2_ranks(self):
        """text -> tokenize_text.py -> 30 steps of configs/gpt2_finetune_small.yaml on 2 ranks from a random
        GPT2LMHeadModel through import_gpt2.py -> --sample prints text -> export_torch.py --gpt2 ->
        Hugging Face's greedy continuation equals --sample --temperature 0's, 20 tokens."""
        try:
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            self.skipTest("no Hugging Face transformers (make pydeps)")
        w = self.w
        cfg = GPT2Config(vocab_size=50257, n_positions=64, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", layer_norm_epsilon=1e-5)
        torch.manual_seed(0)
        GPT2LMHeadModel(cfg).save_pretrained(w.file("hf"))
        p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "import_gpt2.py"), w.file("hf"),
                            w.file("init.h5")], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        sets = ["--set", f"data.path={w.file('text.h5')}", "--set", f"checkpoint.dir={w.file('small')}", "--set",
                f"log.dir={w.file('small')}"]
        rc, out, err = run(["configs/gpt2_finetune_small.yaml", "--set", f"model.init_from={w.file('init.h5')}",
                            "--set", "train.max_steps=30"] + sets, np_=2, timeout=600)
        self.assertEqual(rc, 0, out + err)
        prompt = "The meaning of life is"
        rc, out, err = run(["configs/gpt2_finetune_small.yaml", "--resume", "auto", "--sample", "20", "--prompt", prompt,
                            "--temperature", "0"] + sets, np_=2, timeout=300)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("\n" + prompt, out)
        ours = out[out.index("\n" + prompt) + 1 + len(prompt):-1]
        with open(os.path.join(w.file("small"), "latest")) as f:
            ckpt = os.path.join(w.file("small"), f.read().strip())
        p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "export_torch.py"), ckpt, w.file("hfout") + "/",
                            "--gpt2"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        model = GPT2LMHeadModel.from_pretrained(w.file("hfout")).eval()
        ids = self.tok.encode(prompt).ids
        new = []
        with torch.no_grad():  # greedy, as generate(do_sample=False), which needs a newer torch here
            for _ in range(20):
                new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
        theirs = self.tok.decode(new, skip_special_tokens=False)
        self.assertEqual(ours, theirs)


if __name__ == "__main__":
    unittest.main()
