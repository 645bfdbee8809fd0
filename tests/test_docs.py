"""The docs: a front page of at most 200 lines whose layout map matches the tree; every generated
region current with the snapshot in docs/data/ and no figure typed by hand (a planted stale number
and a planted hand-typed number fail the check); every benchmark that feeds a block run by
`make bench`; relative links that resolve. Tables here are BUILT BY HAND (not measurements)."""

from __future__ import annotations

import ast
import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report import readme
from kvbench.report.blocks import Block, registry
from kvbench.report.findings import FINDINGS
from kvbench.report.numbers import hand_typed
from kvbench.report.tabledocs import undocumented
from kvbench.tinyrun import REPO

PROV = {"config_hash": "feedbeef", "git_commit": "0123456789abcdef"}


@pytest.fixture(scope="module")
def blocks() -> dict[str, Block]:
    return registry(REPO)


def copy_docs(root: Path) -> Path:
    """The repository's documents and snapshot, copied to `root`."""
    for doc in readme.documents(REPO):
        target = root / doc.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(doc, target)
    if (REPO / readme.SNAPSHOT).is_dir():
        shutil.copytree(REPO / readme.SNAPSHOT, root / readme.SNAPSHOT, dirs_exist_ok=True)
    return root


def problems_of(root: Path, blocks) -> list[str]:
    return readme.check(root, blocks)


# --- the repository's docs ------------------------------------------------------------------------


def test_the_docs_are_current_and_hold_no_hand_typed_figure(blocks):
    assert problems_of(REPO, blocks) == []


def test_a_number_edited_inside_a_generated_region_makes_it_stale(tmp_path, blocks):
    root = copy_docs(tmp_path)
    doc = root / "docs" / "results.md"
    text = doc.read_text()
    start = text.index("<!-- generated:kv -->") + len("<!-- generated:kv -->")
    doc.write_text(text[:start] + "\n| 41.6 |\n" + text[start:])  # a planted number in the block
    assert any(p.startswith("docs/results.md: stale generated region(s) kv") for p in problems_of(root, blocks))


def test_a_hand_typed_figure_in_prose_fails_the_check_and_names_its_line(tmp_path, blocks):
    root = copy_docs(tmp_path)
    front = root / "README.md"
    front.write_text(front.read_text() + "\nOn our run zstd-3 compresses realistic text 1.28× (see `kv: 32`).\n")
    line = len(front.read_text().splitlines())
    design = root / "docs" / "kv.md"
    design.write_text(design.read_text() + "\nA capture takes 57 s with `window: 32` and 4 documents.\n")
    found = problems_of(root, blocks)
    assert [p for p in found if "hand-typed" in p] == [
        f"README.md:{line}: hand-typed number '1.28×' (results documents quote figures only through generated regions)",
        f"docs/kv.md:{len(design.read_text().splitlines())}: hand-typed number '57 s' (a time, speed or ratio typed "
        "by hand is a measurement: generate it or put a setting in `code`)",
    ]


# --- the check on a small repository of its own --------------------------------------------------


def summary_table(inflation: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "dtype": "bf16",
                "codec": "zstd-3",
                "comparison": "dummy_vs_real",
                "benchmark_setting": "realistic+dummy",
                "realistic_setting": "realistic+real",
                "benchmark_ratio": 1.25 * inflation,
                "realistic_ratio": 1.25,
                "inflation": inflation,
                "layer_inflation": 2.0,
                "benchmark_below_normal_pct": 0.0,
                **PROV,
            }
        ]
    )


def small_repo(tmp_path: Path, text: str) -> Path:
    (tmp_path / "README.md").write_text(text)
    return tmp_path


def test_a_table_changed_after_the_snapshot_makes_its_regions_stale_until_make_readme(tmp_path, blocks):
    used = {name: blocks[name] for name in ("kv", "finding-kv")}
    root = small_repo(
        tmp_path,
        "# t\n\n<!-- generated:kv -->\n<!-- end generated:kv -->\n\n"
        "- kv: <!-- generated:finding-kv --><!-- end generated:finding-kv -->.\n",
    )
    (root / "results" / "kv").mkdir(parents=True)
    summary_table(32.5).to_parquet(root / "results" / "kv" / "summary.parquet")
    assert problems_of(root, used) == ["README.md: stale generated region(s) kv, finding-kv (run `make readme`)"]
    readme.take_snapshot(root / "results", root / readme.SNAPSHOT, {"kv/summary.parquet"})
    root.joinpath("README.md").write_text(
        readme.rendered(root.joinpath("README.md").read_text(), used, root / readme.SNAPSHOT)[0]
    )
    text = root.joinpath("README.md").read_text()
    assert "config feedbeef, commit 0123456789ab" in text and "| 32.5 |" in text
    assert "dummy weights inflate the ratio 32.5×" in text and problems_of(root, used) == []
    summary_table(30.1).to_parquet(root / readme.SNAPSHOT / "kv" / "summary.parquet")  # the data moved on
    assert problems_of(root, used) == ["README.md: stale generated region(s) kv, finding-kv (run `make readme`)"]


def test_make_readme_snapshots_what_results_has_keeps_what_it_lacks_and_drops_what_nothing_reads(tmp_path, monkeypatch):
    used = {
        "kv": Block(lambda t: t[["inflation"]], ("kv/summary.parquet",)),
        "peers": Block(lambda t: t, ("bench/pairs.parquet",), make="make bench-peers"),
        "late": Block(lambda t: "never", ("bench/late.parquet",), make="make bench-late", inline=True),
    }
    monkeypatch.setattr(readme, "registry", lambda root: used)
    root = small_repo(tmp_path, "".join(f"<!-- generated:{n} -->\n<!-- end generated:{n} -->\n" for n in used))
    (root / "results" / "kv").mkdir(parents=True)
    summary_table(32.5).to_parquet(root / "results" / "kv" / "summary.parquet")
    snapshot = root / readme.SNAPSHOT
    (snapshot / "bench").mkdir(parents=True)
    pd.DataFrame({"x": [7.0], **{k: [v] for k, v in PROV.items()}}).to_parquet(snapshot / "bench" / "pairs.parquet")
    pd.DataFrame({"x": [1]}).to_parquet(snapshot / "bench" / "gone.parquet")  # no block reads it any more
    assert readme.main([str(root)]) == 0
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.parquet")) == [
        "bench/pairs.parquet",
        "kv/summary.parquet",
    ]
    text = (root / "README.md").read_text()
    assert "| 32.5 |" in text and "| 7 |" in text  # the fresh table, and the earlier snapshot kept
    assert "<!-- generated:late -->not measured yet (`make bench-late`, then `make readme`)<!--" in text
    assert readme.main([str(root), "--check"]) == 0


def test_unknown_doubled_and_unplaced_blocks_and_unread_snapshot_tables_are_named(tmp_path):
    used = {"kv": Block(lambda t: t, ("kv/summary.parquet",)), "lonely": Block(lambda: "x")}
    root = small_repo(
        tmp_path,
        "<!-- generated:kv -->\n<!-- end generated:kv -->\n<!-- generated:nobody -->\n<!-- end generated:nobody -->\n",
    )
    (root / "docs").mkdir()
    (root / "docs" / "more.md").write_text("<!-- generated:kv -->\n<!-- end generated:kv -->\n")
    (root / readme.SNAPSHOT / "old").mkdir(parents=True)
    pd.DataFrame({"x": [1]}).to_parquet(root / readme.SNAPSHOT / "old" / "t.parquet")
    found = " ; ".join(problems_of(root, used))
    assert "README.md: region `nobody` is declared by no registry" in found
    assert "block `kv` is placed twice" in found and "block `lonely` is placed in no document" in found
    assert "docs/data/old/t.parquet: no generated region reads this snapshot table" in found


@pytest.mark.parametrize(
    ("text", "results", "found"),
    [
        ("zstd-3 compresses it 1.28x, KIVI-2 at fp16", True, ["1.28x"]),
        ("a 4K prompt on Llama-3.1-8B, SmolLM2-135M, 2nd run", True, []),
        ("`window: 32` in `config/config.yaml`, see [x](a/b2.md)", True, []),
        ("> the seed: 2 unique tokens (0.02 %)", True, []),
        ("budget ≤ 1.3× and ≥ 50 %", True, []),
        ("the run took 22.1 min and 444 job-seconds", True, ["22.1 min", "444 job-seconds"]),
        ("7 samples of 3 categories", True, ["7", "3"]),
        ("7 samples of 3 categories, 30 layers × 2 × 64 B = 0.98 MB", False, []),
        ("vLLM starts in ~65 s; it decodes 5 tok/s, 1.2× slower", False, ["65 s", "5 tok/s", "1.2×"]),
        ("```\nrun 12 s\n```\n<!-- generated:x -->took 9 s<!-- end generated:x -->", False, []),
    ],
)
def test_which_numbers_count_as_hand_typed_figures(text, results, found):
    assert [figure for _, figure in hand_typed(text, results)] == found


# --- the front page and the tree -----------------------------------------------------------------


def layout_map() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"^## Layout\n\n```\n(.*?)^```", text, flags=re.S | re.M).group(1)
    return [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]


def expand(entry: str) -> list[str]:
    braces = re.search(r"\{([^}]*)\}", entry)
    if not braces:
        return [entry.rstrip("/")]
    return [
        p for alt in braces.group(1).split(",") for p in expand(entry[: braces.start()] + alt + entry[braces.end() :])
    ]


def test_the_front_page_is_short_and_its_layout_map_matches_the_tree():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    folders = {"/".join(p.split("/")[:i]) for p in tracked for i in range(1, p.count("/") + 1)}
    entries = layout_map()
    for entry in entries:  # each entry exists; a `{a,b}` entry lists every file of its kind there
        paths = expand(entry)
        assert all(p in tracked or p in folders for p in paths), entry
        if "{" in entry:
            kind = re.sub(r"\{[^}]*\}", "*", entry)
            assert sorted(paths) == sorted(
                p for p in tracked if fnmatch.fnmatchcase(p, kind) and "/" not in p[len(kind.split("*")[0]) :]
            ), entry
    listed = [p for e in entries for p in expand(e)]
    required = {p.split("/")[0] for p in tracked} | {f for f in folders if f.count("/") == 1}
    missing = {
        r for r in required - {"README.md", ".gitignore"} if not any(p == r or p.startswith(r + "/") for p in listed)
    }
    assert not missing, f"not in the README's layout map: {sorted(missing)}"


def test_every_block_of_a_benchmark_is_run_by_make_bench(blocks):
    makefile = (REPO / "Makefile").read_text()
    recipes = {
        m.group(1): (m.group(2).split(), m.group(3))
        for m in re.finditer(r"^([\w-]+):([^\n=]*)\n((?:\t[^\n]*\n)*)", makefile, flags=re.M)
    }

    def runs(target: str) -> str:
        prerequisites, recipe = recipes[target]
        return recipe + "".join(runs(p) for p in prerequisites if p in recipes)

    from kvbench.report.blocks import BENCH_SCRIPTS, bench_script

    for script in BENCH_SCRIPTS:
        for name, block in bench_script(REPO, script).BLOCKS.items():
            target = block.make.removeprefix("make ")
            assert f"bench/{script}.py" in runs(target), (name, block.make)
            if target != "bench-gpu":  # needs a GPU host: `make bench` runs on this machine
                assert f"bench/{script}.py" in runs("bench"), name


def test_relative_links_of_the_docs_resolve():
    def anchors(path: Path) -> set[str]:
        return {
            re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
        }

    for doc in readme.documents(REPO):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.exists(), (doc, target)
            assert not anchor or anchor in anchors(path), (doc, target)


# --- findings: sentences from hand-built tables --------------------------------------------------


def say(name: str, *tables: pd.DataFrame) -> str:
    return FINDINGS[name].render(*tables)


def correlations(low: float, high: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "model": "m",
                "category": "all categories (pooled)",
                "outcome": "quality",
                "rho": 0.26,
                "ci_low": low,
                "ci_high": high,
                "methods": 11,
                "samples": 7,
                "level": 0.95,
            }
        ]
    )


def test_a_correlation_says_inconclusive_when_its_interval_holds_zero_and_shows_the_interval():
    assert say("finding-ratio-predicts", correlations(-0.55, 0.59)) == (
        "Spearman's ρ of the measured ratio across 11 methods, pooled over categories (95 % bootstrap intervals, "
        "7 samples): with quality ρ +0.26 [-0.55, +0.59] (inconclusive)"
    )
    assert say("finding-ratio-predicts", correlations(0.1, 0.59)).endswith("[+0.10, +0.59] (the interval excludes 0)")
    # samples sharing documents: the interval's n is the documents, said beside the samples
    assert "(95 % bootstrap intervals, 3 documents, 7 samples)" in say(
        "finding-ratio-predicts", correlations(-0.55, 0.59).assign(documents=3)
    )


def test_fidelity_pairs_show_an_interval_where_the_summary_has_one():
    rows = pd.DataFrame(
        [
            {"model": "m", "method": m, "category": "all", "kl_mean": kl, "score_mean": s, "samples": 7}
            for m, kl, s in [("full", None, 0.17), ("kivi2", 0.30, 0.2), ("kivi4", 0.015, 0.1)]
        ]
    )
    assert say("finding-fidelity", rows) == (
        "m, query-aware: KL(full ‖ method) per decode position, kivi2 0.3 vs kivi4 0.015; "
        "`full`'s own task score is 0.17 over 7 samples"
    )
    # Both protocols: one part each, the first answer token's KL only where it is not exact by construction.
    both = pd.concat(
        [
            rows.assign(protocol="query-aware", kl_first_mean=[None, 0.0, 0.0]),
            rows.assign(protocol="context-only", kl_first_mean=[None, 0.5, 0.02]),
        ]
    )
    said = say("finding-fidelity", both)
    assert said.count("KL(full ‖ method)") == 2 and said.count("first answer token") == 1
    assert (
        "context-only: KL(full ‖ method) per decode position, kivi2 0.3 vs kivi4 0.015; KL at the first answer token from 0.02 (kivi4) to 0.5 (kivi2)"
        in said
    )
    with_ci = rows.assign(kl_mean_ci_low=[None, 0.2, 0.01], kl_mean_ci_high=[None, 0.4, 0.02])
    assert "kivi2 0.3 [0.2, 0.4] vs kivi4 0.015 [0.01, 0.02]" in say("finding-fidelity", with_ci)


def test_the_wire_finding_counts_lossless_and_lossy_hits_separately():
    rows = pd.DataFrame(
        [
            {
                "backend": "valkey",
                "codec": "none",
                "ratio": 1.0,
                "predicted_ratio": 1.0,
                "outputs_identical_share": 1.0,
                "outputs_compared": 3,
            },
            {
                "backend": "valkey",
                "codec": "zstd-3",
                "ratio": 1.08,
                "predicted_ratio": 1.1,
                "outputs_identical_share": 1.0,
                "outputs_compared": 3,
            },
            {
                "backend": "valkey",
                "codec": "kivi2",
                "ratio": 10.7,
                "predicted_ratio": None,
                "outputs_identical_share": 1 / 3,
                "outputs_compared": 3,
            },
            {
                "backend": "valkey",
                "codec": "all",
                "ratio": None,
                "predicted_ratio": None,
                "outputs_identical_share": None,
                "outputs_compared": 0,
            },
            {
                "backend": "prefix",
                "codec": "-",
                "ratio": None,
                "predicted_ratio": None,
                "outputs_identical_share": 1.0,
                "outputs_compared": 3,
            },
        ]
    )
    assert say("finding-wire", rows) == (
        "through vLLM and Valkey, every lossless codec's measured wire ratio lies within 1.82 % of the kv stage's "
        "prediction (2 codec × corpus cells), and 6 of 6 cache hits answered exactly as recompute did; through the "
        "lossy wire formats (kivi2) 1 of 3 did"
    )


def test_the_overhead_finding_reads_the_verdicts_of_real_weights():
    def row(codec, corpus, ratio, low, high, verdict, weights="real"):
        what = "warmup" if codec == "all" else "miss"
        return {
            "backend": "valkey",
            "weights": weights,
            "codec": codec,
            "corpus": corpus,
            f"{what}_vs_recompute": ratio,
            f"{what}_vs_recompute_ci_low": low,
            f"{what}_vs_recompute_ci_high": high,
            "overhead_budget": 1.15,
            "overhead_verdict": verdict,
        }

    rows = pd.DataFrame(
        [
            row("all", "realistic", 1.07, 0.98, 1.13, "within 1.15x at n=6"),
            row("zstd-3", "realistic", 1.1, 1.02, 1.13, "within 1.15x at n=7"),
            row("none", "realistic", 1.05, 1.01, 1.18, "undecided at n=7"),
            row("fp8", "realistic", 1.3, 1.2, 1.4, "over 1.15x at n=7"),
            row("zstd-3", "synthetic", 1.0, None, None, "undecided at n=3"),
            row("all", "realistic", 1.5, 1.4, 1.6, "over 1.15x at n=6", weights="dummy"),
            row("-", "realistic", 1.01, 0.97, 1.06, None) | {"backend": "prefix", "miss_vs_recompute_n": 7},
        ]
    )
    assert say("finding-overhead", rows) == (
        "TTFT with our connector over a recompute's (geometric mean of paired ratios), warm-up storing all 3 codecs "
        "in the background: realistic 1.07 [0.98, 1.13] (within 1.15x at n=6); misses on realistic documents (each "
        "storing its codec): over 1.15x for fp8 1.3 [1.2, 1.4] (n=7); undecided for none 1.05 [1.01, 1.18] (n=7); "
        "within 1.15x for zstd-3 1.1 [1.02, 1.13] (n=7); the control, vLLM's prefix-cache misses (nothing "
        "offloaded: the drift and noise left), 1.01 [0.97, 1.06] (n=7) (95 % intervals, budget 1.15×)"
    )


def test_a_finding_whose_rows_are_missing_says_so():
    assert say("finding-kv", summary_table(3.0).assign(dtype="fp16")).startswith("not measured in this snapshot")


# --- the output-table reference --------------------------------------------------------------------


def test_undocumented_tables_and_columns_are_named(tmp_path):
    reference = """## Provenance
`config_hash`

### `results/kv/{corpus}/summary.parquet`, `results/kv/summary.parquet`
`ratio_min|max`, `kv_ratio_{real,dummy}`, `*_std`, `<column>_rel`, `text[a:b]`
"""
    (tmp_path / "results" / "kv" / "synthetic").mkdir(parents=True)
    documented = pd.DataFrame(
        {c: [1.0] for c in ["config_hash", "ratio_min", "ratio_max", "kv_ratio_dummy", "ttft_std", "ttft_rel"]}
    )
    documented.assign(surprise=1.0).to_parquet(tmp_path / "results" / "kv" / "synthetic" / "summary.parquet")
    documented.to_parquet(tmp_path / "results" / "kv" / "summary.parquet")
    documented.to_parquet(tmp_path / "results" / "kv" / "other.parquet")
    assert undocumented(tmp_path, reference) == [
        "results/kv/other.parquet: no section in the table reference",
        "results/kv/synthetic/summary.parquet: column `surprise` is not documented",
    ]


def _top_level(module: Path) -> dict[str, ast.AST]:
    """The names a module defines or imports at top level -> their node."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id: node for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0]: node for a in node.names}
    return names


def _members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    names = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for n in cls.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {t.id: n for t in targets if isinstance(t, ast.Name)}
    return names


def resolves(reference: str) -> bool:
    """`kvbench.a.b.C.d`: packages and modules under workflow/, then a top-level name of the module,
    then members of a class, read from the source (nothing imported)."""
    parts, path = reference.split("."), REPO / "workflow" / "kvbench"
    rest = parts[1:]
    while rest and ((path / rest[0]).is_dir() or (path / f"{rest[0]}.py").is_file()):
        path = path / rest[0] if (path / rest[0]).is_dir() else path / f"{rest[0]}.py"
        rest = rest[1:]
    if not rest:
        return True
    module = path / "__init__.py" if path.is_dir() else path
    node = _top_level(module).get(rest[0]) if module.is_file() else None
    for attr in rest[1:]:  # members of a class, declared in its body (a chain goes on only through classes)
        node = _members(node).get(attr) if isinstance(node, ast.ClassDef) else None
    return node is not None


def test_every_kvbench_name_the_docs_and_docstrings_cite_exists():
    sources = [
        *(REPO / p for p in ("README.md", "config/README.md", "bench/README.md", "Snakefile")),
        *(REPO / "docs").glob("*.md"),
        *(REPO / "workflow").rglob("*.py"),
        *(REPO / "workflow" / "rules").glob("*.smk"),
        *(REPO / "bench").glob("*.py"),
        *(p for p in (REPO / "tests").glob("*.py") if p.name != "test_docs.py"),  # it cites stale ones on purpose
    ]
    cited = {
        (ref, path.relative_to(REPO).as_posix())
        for path in sources
        for ref in re.findall(r"\bkvbench(?:\.[A-Za-z_]\w*)+", path.read_text())
        if "__" not in ref
    }
    assert len(cited) > 100
    assert sorted((ref, where) for ref, where in cited if not resolves(ref)) == []


def test_a_stale_kvbench_name_does_not_resolve():
    assert resolves("kvbench.hub.HUB_FILES") and resolves("kvbench.decode.Row.tpot_s")
    assert not resolves("kvbench.models.HUB_FILES") and not resolves("kvbench.harness.generate_scored")
    assert not resolves("kvbench.decode.Row.no_such_member") and not resolves("kvbench.decode.Row.tokens.tpot_s")
