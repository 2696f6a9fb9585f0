"""The documentation's links and the README's promises: every relative link in README.md, docs/*.md and
the Markdown files they link to (benchmarks/README.md, tests/gpusim/README.md) names a file or folder that
exists, and an anchor into a Markdown file names one of its headings, by GitHub's rules (lowercase,
punctuation dropped, spaces to '-', -1, -2 for repeats). Every page of docs/ is linked from the README;
the README stays under 300 lines and its first two commands are `make run` and `make test`. A broken
link of each kind, planted in a temporary tree, must be reported."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from urllib.parse import unquote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading):
    """GitHub's anchor for a heading's text: links reduced to their text, code spans to their
    content, then lowercase, every character but letters, digits, '_', '-' and spaces dropped,
    spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    seen, out = {}, set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def links(path):
    """(line number, target) of every link and link definition outside code."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for n, line in prose_lines(text):
        bare = CODE_SPAN.sub("", line)
        for m in INLINE_LINK.finditer(bare):
            yield n, m.group(1)
        m = REF_DEF.match(bare)
        if m:
            yield n, m.group(1)


def is_external(target):
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None or target.startswith("//")


def check(root, starts):
    """Follows relative links from the Markdown files `starts` (paths under root) through every
    Markdown file they reach; returns (problems, pages reached)."""
    problems, todo, done = [], [os.path.join(root, s) for s in starts], set()
    while todo:
        page = os.path.normpath(todo.pop())
        if page in done:
            continue
        done.add(page)
        rel_page = os.path.relpath(page, root)
        for n, target in links(page):
            if is_external(target):
                continue
            where = f"{rel_page}:{n}: ({target})"
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), unquote(path))) if path else page
            if not os.path.realpath(dest).startswith(os.path.realpath(root) + os.sep):
                problems.append(f"{where} leaves the repository")
                continue
            if not os.path.exists(dest):
                problems.append(f"{where}: no such file {os.path.relpath(dest, root)}")
                continue
            if dest.endswith(".md") and os.path.isfile(dest):
                if anchor and unquote(anchor) not in anchors(dest):
                    problems.append(f"{where}: {os.path.relpath(dest, root)} has no heading #{anchor}")
                todo.append(dest)
            elif anchor and os.path.isfile(dest):
                problems.append(f"{where}: an anchor into a file that is not Markdown")
    return problems, done


def start_pages(root):
    docs = os.path.join(root, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


def commands(text):
    """The command lines of the fenced shell blocks, in order (comments and blank lines left out)."""
    out, fenced, shell = [], False, False
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            if not fenced:
                lang = line.strip()[3:].strip().lower()
                shell = lang in ("", "sh", "bash", "shell", "console")
            fenced = not fenced
            continue
        if fenced and shell:
            cmd = line.split(" #", 1)[0].strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


class Links(unittest.TestCase):
    def test_every_relative_link_resolves(self):
        problems, reached = check(ROOT, start_pages(ROOT))
        if problems:
            self.fail("broken links:\n" + "\n".join(problems))
        for page in ("benchmarks/README.md", "tests/gpusim/README.md"):  # the pages docs/ leans on
            self.assertIn(os.path.join(ROOT, page), reached, f"{page} is linked from nowhere")

    def test_every_docs_page_is_linked_from_the_readme(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            targets = {os.path.normpath(t.partition("#")[0]) for _, t in links(f.name)}
        for page in start_pages(ROOT)[1:]:
            self.assertIn(page, targets, f"README.md does not link to {page}")

    def test_slugs_follow_github(self):
        self.assertEqual(slug("Checkpoints and the model layout (`model.init_from`)"),
                         "checkpoints-and-the-model-layout-modelinit_from")
        self.assertEqual(slug("On a GPU machine: `scripts/gpu_check.sh`"), "on-a-gpu-machine-scriptsgpu_checksh")
        self.assertEqual(slug("`--dry-run`"), "--dry-run")
        self.assertEqual(slug("Sanitizers, fuzzing, repeats and long runs"), "sanitizers-fuzzing-repeats-and-long-runs")

    def test_a_broken_link_is_reported(self):
        """The checker itself, on a planted tree: a missing file, a missing heading, a missing
        same-page heading and a missing file two pages away are each reported; code is not read."""
        tmp = tempfile.mkdtemp()
        try:
            os.makedirs(os.path.join(tmp, "docs"))
            files = {
                "README.md": "# Top\n\n## Exit codes\n\n[ok](docs/a.md#the-page) [gone](docs/missing.md)\n"
                             "[self](#exit-codes) [bad self](#no-such)\n"
                             "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n",
                "docs/a.md": "# The page\n\n[back](../README.md#top) [no heading](../README.md#status)\n"
                             "[on](b.md) [web](https://example.com/x.md)\n",
                "docs/b.md": "# B\n\n[two away](../c.md)\n",
            }
            for name, text in files.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            problems, _ = check(tmp, ["README.md"])
            self.assertEqual(len(problems), 4, "\n".join(problems))
            for expect in ("docs/missing.md", "#no-such", "#status", "c.md"):
                self.assertTrue(any(expect in p for p in problems), (expect, problems))
        finally:
            shutil.rmtree(tmp)


class Readme(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            self.text = f.read()

    def test_under_300_lines(self):
        n = len(self.text.splitlines())
        self.assertLess(n, 300, f"README.md has {n} lines: move the detail to docs/")

    def test_first_two_commands_are_make_run_and_make_test(self):
        self.assertEqual([c.split()[:2] for c in commands(self.text)[:2]], [["make", "run"], ["make", "test"]])

    def test_the_gpt2_memory_table_is_current(self):
        """scripts/memory_table.py's table, from --dry-run's estimate, is the README's."""
        p = subprocess.run([sys.executable, "scripts/memory_table.py"], capture_output=True, text=True, cwd=ROOT)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(p.stdout, self.text, "run /usr/bin/python3 scripts/memory_table.py and update README.md")

    def test_every_exit_code_is_in_the_table(self):
        codes = set(re.findall(r"^\| (\d+) \|", self.text, re.M))
        self.assertEqual(codes, {"0", "2", "3", "4", "5", "70", "75"})


if __name__ == "__main__":
    unittest.main()
