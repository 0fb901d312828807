"""Read measured results into tidy pandas frames; write the aggregated tables.

Layout (DESIGN §2): ``results/<platform>/<experiment>/<point>.json`` (one row each, written by
the runners) -> ``results/<platform>/<experiment>.csv`` (one measurement a row, the DESIGN
columns first, nested fields flattened, samples dropped). Notebooks and the REPRODUCTION.md
generator read the CSVs through ``load_table``; every row is checked against
``result.schema.yaml`` (``fsalab.data``) on the way in. ``aggregate`` refuses a folder whose
rows were measured on another machine than the folder's, a table bound for another platform's
folder, and replacing a table by one of fewer rows (``--force`` to do so).
``migrate_point_ids`` renames point files whose id is not the one their parameters give (ids
hash every parameter, ``fsalab.bench.points.point_hash``), without re-measuring anything.
``collect`` brings the point files of a device call's ``results.tgz`` into this tree, adding
only those it lacks, so the next call's ``--skip-existing`` sees them.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pandas as pd
import yaml

from . import data
from .bench.decode_points import DEFAULTS as DECODE_DEFAULTS
from .bench.decode_points import OPS as DECODE_OPS
from .bench.grid import known_experiments, load_schema, validate
from .bench.points import E2E_OPS, e2e_base, point_hash
from .bench.repo import repo_root
from .bench.rows import COLUMNS  # DESIGN §2 columns, in order
# Flattened nested fields: column -> path inside the JSON row.
_NESTED = {
    "check_status": ("check", "status"),
    "check_tokens": ("check", "tokens"),
    "check_max_err": ("check", "outputs", "o", "max_err"),
    "timing_method": ("timing", "method"),
    "indices_from": ("inputs", "indices_from"),
    "mean_selected_blocks": ("inputs", "mean_selected_blocks"),
    "gpu": ("provenance", "gpu"),
    "driver": ("provenance", "driver"),
    "torch": ("provenance", "torch"),
    "triton": ("provenance", "triton"),
    "git_commit": ("provenance", "git_commit"),
    "git_dirty": ("provenance", "git_dirty"),
    "timestamp": ("provenance", "timestamp"),
    # versus runner: median ms of each NSA branch timed alone
    **{f"split_{b}_ms": ("split_ms", b) for b in ("compression", "selection", "selected", "window", "gate")},
}
_DROP = {"samples_ms", "graph_samples_ms", "split_ms", "provenance", "check", "timing", "inputs", "traceback", "sources"}


def results_root(results_dir: str | Path | None = None) -> Path:
    """``results_dir`` or ``<repo>/results``."""
    return Path(results_dir) if results_dir is not None else repo_root() / "results"


def platforms(results_dir: str | Path | None = None) -> list[str]:
    """Platforms with a results folder, sorted."""
    root = results_root(results_dir)
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def platform_folder(platform: str, results_dir: str | Path | None = None) -> Path:
    """``results/<platform>/`` when it holds results (tables or point files); ValueError saying
    what is missing otherwise (the results folder, the platform's folder, or any result in it)."""
    root = results_root(results_dir)
    if not root.is_dir():
        raise ValueError(f"no results folder {root}")
    folder = root / platform
    if not folder.is_dir():
        raise ValueError(f"no results of platform {platform!r} in {root}/ "
                         f"(platforms there: {', '.join(platforms(results_dir)) or 'none'})")
    if not any(folder.glob("*.csv")) and not any(folder.glob("*/*.json")):
        raise ValueError(f"{folder}/ holds no results (no <experiment>.csv, no <experiment>/<point>.json)")
    return folder


def _get(row: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(row, dict) or key not in row:
            return None
        row = row[key]
    return row


def flatten(row: dict) -> dict:
    """One JSON result row -> one flat table row (DESIGN columns first)."""
    flat = {c: row.get(c) for c in COLUMNS}
    for key, value in row.items():
        if key in flat or key in _DROP:
            continue
        flat[key] = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
    for col, path in _NESTED.items():
        flat[col] = _get(row, path)
    if isinstance(row.get("sources"), dict):
        flat.update({f"source_{k}": v for k, v in row["sources"].items()})
    return flat


def load_rows(platform: str, experiment: str, results_dir: str | Path | None = None,
              points: list[str] | None = None) -> list[dict]:
    """Every JSON row of ``results/<platform>/<experiment>/`` (only the point ids ``points`` if
    given: a missing one is an error), schema-checked, sorted by point."""
    folder = results_root(results_dir) / platform / experiment
    schema = load_schema("result")
    rows = []
    paths = sorted(folder.glob("*.json")) if points is None else [folder / f"{p}.json" for p in sorted(points)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"no point file {missing[0]}{more}")
    for path in paths:
        rows.append(validate(json.loads(path.read_text()), schema, str(path)))
    return rows


def to_frame(rows: list[dict]) -> pd.DataFrame:
    """Tidy frame of rows; an empty frame still has the DESIGN columns."""
    if not rows:
        return pd.DataFrame(columns=list(COLUMNS))
    return pd.DataFrame([flatten(r) for r in rows])


def check_machines(platform: str, rows: list[dict]) -> None:
    """PlatformMismatch when a row was measured on another machine than the folder's, or when
    the folder's rows come from several machines."""
    from .bench.provenance import PlatformMismatch, check_destination, row_machine

    for row in rows:
        check_destination(row, platform)
    machines = sorted({row_machine(r) for r in rows})
    if len(machines) > 1:
        raise PlatformMismatch(f"results/{platform}/ holds rows measured on several machines {machines}; "
                               "refusing to aggregate them into one table (--force to do so)")


class FewerRows(ValueError):
    """An aggregated table was about to replace one with more rows."""


def row_count(csv: str | Path) -> int | None:
    """Rows of an aggregated table, None when there is no file."""
    csv = Path(csv)
    if not csv.is_file():
        return None
    try:
        return len(pd.read_csv(csv))
    except pd.errors.EmptyDataError:
        return 0


def check_table_destination(out: Path, platform: str, rows: list[dict], results_dir: str | Path | None = None) -> None:
    """PlatformMismatch when the table of ``results/<platform>/`` would be written into another
    platform's folder of the results root, or its rows into a folder named for another machine."""
    from .bench.provenance import PlatformMismatch, check_destination

    root = results_root(results_dir).resolve()
    folder = out.resolve().parent
    if folder.parent == root and folder.name != platform:
        raise PlatformMismatch(f"{out} is the table of results/{folder.name}/, the rows come from results/{platform}/; "
                               f"refusing to write them there (write outside the results folder, or --force)")
    if folder.name != platform:
        for row in rows:
            check_destination(row, folder.name)


def aggregate(platform: str, experiment: str, results_dir: str | Path | None = None, out: str | Path | None = None,
              force: bool = False, points: list[str] | None = None, fewer_ok: bool = False) -> Path:
    """Write ``results/<platform>/<experiment>.csv`` from the point files (every file of the
    folder, or the point ids ``points``: the workflow passes its grid's, so files of points no
    longer in the grid stay on disk but out of the table); returns its path.
    Unless ``force``: rows measured on another machine than the folder's, a table bound for
    another platform's folder (``out``) and, unless ``fewer_ok``, one that would replace a
    table of more rows are refused."""
    rows = load_rows(platform, experiment, results_dir, points)
    out = Path(out) if out is not None else results_root(results_dir) / platform / f"{experiment}.csv"
    if not force:
        check_machines(platform, rows)
        check_table_destination(out, platform, rows, results_dir)
        before = row_count(out)
        if not fewer_ok and before is not None and len(rows) < before:
            raise FewerRows(f"{out} holds {before} rows; refusing to replace it by a table of {len(rows)} "
                            "(--force to do so)")
    df = to_frame(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    return out


def load_table(platform: str, experiment: str, results_dir: str | Path | None = None) -> pd.DataFrame:
    """The aggregated table, or one built from the point files when the CSV is missing;
    an empty frame (with the DESIGN columns) when there are no results at all."""
    root = results_root(results_dir)
    csv = root / platform / f"{experiment}.csv"
    if csv.is_file():
        # A short commit of digits only (e.g. 1434595) is a name, not a number.
        df = pd.read_csv(csv, dtype={"git_commit": str})
        return df if len(df.columns) else pd.DataFrame(columns=list(COLUMNS))
    return to_frame(load_rows(platform, experiment, results_dir)) if (root / platform / experiment).is_dir() else to_frame([])


def multi_gpu_hosts(platform: str, results_dir: str | Path | None = None) -> list[str]:
    """The results folders of multi-GPU hosts of ``platform``'s GPU: ``<platform>x<GPUs>``
    (e.g. h200x2), sorted; h200x2 is one of h200's, h200-smoke is not."""
    return [p for p in platforms(results_dir) if re.fullmatch(rf"{re.escape(platform)}x\d+", p)]


def multi_gpu_table(platform: str, experiment: str, results_dir: str | Path | None = None) -> pd.DataFrame:
    """``experiment``'s rows from every multi-GPU host of ``platform``'s GPU
    (``multi_gpu_hosts``) in one frame, with ``host`` naming the folder; an empty frame when
    none has results."""
    frames = [load_table(h, experiment, results_dir).assign(host=h) for h in multi_gpu_hosts(platform, results_dir)]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else to_frame([])


def ok(df: pd.DataFrame) -> pd.DataFrame:
    """Rows whose status is ``ok``."""
    return df[df["status"] == "ok"] if "status" in df else df


def paper_values() -> dict:
    """The paper's reported numbers used beside ours (``analysis/paper_values.yaml``)."""
    with open(data.path("paper_values.yaml")) as fh:
        return yaml.safe_load(fh)


_HASH_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def point_of_row(row: dict, stem: str) -> dict:
    """The point parameters a result row was measured with (what its id hashes): the parameter
    keys of the experiment schema found in the row, the runner's defaults for those it lacks.
    ``stem`` (the file name) tells a full-depth end-to-end point (``-Lfull-``) from one whose
    ``layers`` merely equals the model's depth (rows store the depth run); older end-to-end rows
    kept their per-part times under ``split`` (now ``split_parts``), which tells the flag too."""
    schema = load_schema("experiment")
    if row.get("op") in E2E_OPS:
        keys = schema["$defs"]["e2e_params"]["properties"]
        p = {**e2e_base(E2E_OPS[row["op"]]), **{k: row[k] for k in keys if k in row}}
        if "-Lfull-" in stem:
            p["layers"] = None
        if isinstance(row.get("split"), dict):  # rows before split_parts stored the times under split
            p["split"] = any(k.startswith("attention") for k in row["split"])
        return p
    if row.get("op") in DECODE_OPS:  # the decode runner's own parameters (bench.decode_points)
        return {**DECODE_DEFAULTS, **{k: row[k] for k in (*DECODE_DEFAULTS, "op", "impl", "N") if row.get(k) is not None}}
    keys = [k for k in schema["$defs"]["params"]["properties"] if k not in ("label", "cost_model")]
    params_schema = {"$defs": schema["$defs"], **schema["$defs"]["params"]}
    return validate({k: row[k] for k in keys if k in row and row[k] is not None}, params_schema, stem)


def migrate_point_ids(results_dir: str | Path | None = None, dry_run: bool = False) -> list[tuple[str, str]]:
    """Rename every point file ``results/<platform>/<experiment>/<id>.json`` whose id does not
    end with the hash of its parameters (``point_of_row``) to ``<readable prefix>-<hash>.json``
    and set its ``point`` field; nothing else in the file changes (the one ``"point": ...``
    line is replaced in the text, so numbers keep their exact digits). Returns (old, new) paths.
    Run ``aggregate`` afterwards: the CSVs keep their rows, with the new ids."""
    root = results_root(results_dir)
    moves = []
    for path in sorted(root.glob("*/*/*.json")):
        text = path.read_text()
        row = json.loads(text)
        if "point" not in row or "provenance" not in row:
            continue  # not a result row (e.g. a dispatch cache)
        want = f"{_HASH_SUFFIX.sub('', path.stem)}-{point_hash(point_of_row(row, path.stem))}"
        if want == path.stem:
            continue
        new = path.with_name(f"{want}.json")
        if new.exists():
            raise FileExistsError(f"{path} would be renamed to {new}, which exists")
        moves.append((str(path), str(new)))
        if not dry_run:
            field = f'"point": {json.dumps(row["point"])}'
            if text.count(field) != 1:
                raise ValueError(f"{path}: expected one {field!r} to rewrite")
            new.write_text(text.replace(field, f'"point": {json.dumps(want)}'))
            path.unlink()
    return moves


SUPERSEDED = "superseded"


def measured_at_or_after(row_commit: str | None, min_commit: str, repo: str | Path | None = None) -> bool:
    """Whether a row's ``git_commit`` is ``min_commit`` (either a prefix of the other, 7+
    characters) or, as far as the git checkout ``repo`` knows both, a descendant of it. A row
    without a commit, or one git cannot place (a device copy's stale HEAD), counts as older."""
    if not row_commit or len(min_commit) < 7:
        return False
    n = min(len(row_commit), len(min_commit))
    if n >= 7 and row_commit[:n] == min_commit[:n]:
        return True
    import subprocess

    try:
        out = subprocess.run(["git", "merge-base", "--is-ancestor", min_commit, row_commit],
                             cwd=repo or repo_root(), capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


def rerun_seconds(paths: list[str | Path]) -> float:
    """The device seconds the rows of ``paths`` took when measured (their ``elapsed_s``): what
    measuring them again costs, start-up of a device call aside. Rows timed together in one
    group (``group``: the versus runner's interleaved calls, which give each row of a group the
    group's time) count once."""
    seen, total = set(), 0.0
    for path in paths:
        row = json.loads(Path(path).read_text())
        key = (row.get("experiment"), row["group"], row.get("elapsed_s")) if row.get("group") else str(path)
        if key not in seen:
            seen.add(key)
            total += row.get("elapsed_s") or 0.0
    return total


def supersede(platform: str, min_commit: str, results_dir: str | Path | None = None,
              experiments: list[str] | None = None, dry_run: bool = False,
              point_filter: str | None = None) -> list[tuple[str, str]]:
    """Move the point files of ``results/<platform>/<experiment>/`` measured before
    ``min_commit`` (``measured_at_or_after``) to ``results/<platform>/superseded/<experiment>/
    <point>.<commit>.json``, out of every table and of every skip-existing check, so a re-run
    measures those points again at the new commit; nothing is deleted. ``experiments``: only
    these (default: every known experiment); ``point_filter``: only points whose id matches
    this regular expression (``re.search``, as the runners' ``--filter``). Returns (old, new)
    paths."""
    pick = re.compile(point_filter) if point_filter else None
    root = results_root(results_dir) / platform
    moves = []
    for experiment in experiments if experiments is not None else known_experiments():
        for path in sorted((root / experiment).glob("*.json")):
            row = json.loads(path.read_text())
            if "point" not in row or "provenance" not in row:
                continue  # not a result row
            if pick is not None and not pick.search(row["point"]):
                continue
            commit = row["provenance"].get("git_commit")
            if measured_at_or_after(commit, min_commit):
                continue
            new = root / SUPERSEDED / experiment / f"{path.stem}.{(commit or 'unknown')[:7]}.json"
            moves.append((str(path), str(new)))
            if not dry_run:
                new.parent.mkdir(parents=True, exist_ok=True)
                path.replace(new)
    return moves


def restore_unmeasured(platform: str, results_dir: str | Path | None = None, experiments: list[str] | None = None,
                       dry_run: bool = False) -> list[tuple[str, str]]:
    """Put back the rows ``supersede`` set aside whose point has not been measured again: for each
    ``superseded/<experiment>/<point>.<commit>.json`` whose ``<experiment>/<point>.json`` is
    missing, the newest such copy (by its row's timestamp) moves back, so the tables keep every
    point until a re-run measures it. A point measured again keeps its new file. Returns
    (set-aside, restored) paths."""
    root = results_root(results_dir) / platform
    newest: dict[Path, tuple[str, Path]] = {}
    for experiment in experiments if experiments is not None else known_experiments():
        for copy in sorted((root / SUPERSEDED / experiment).glob("*.json")):
            original = root / experiment / f"{copy.name.removesuffix('.json').rsplit('.', 1)[0]}.json"
            if original.exists():
                continue
            try:
                row = json.loads(copy.read_text())
            except (OSError, ValueError):
                continue
            stamp = str((row.get("provenance") or {}).get("timestamp") or "")
            if original not in newest or stamp > newest[original][0]:
                newest[original] = (stamp, copy)
    moves = [(str(copy), str(original)) for original, (_, copy) in sorted(newest.items())]
    if not dry_run:
        for copy, original in moves:
            Path(copy).replace(original)
    return moves


def collect(archives: list[str | Path], results_dir: str | Path | None = None,
            dry_run: bool = False) -> dict[str, list[str]]:
    """Copy the point files of device calls' ``results.tgz`` archives (the ``results/`` tree that
    ``scripts/gpu/pack_results.sh`` packs) into ``results_dir``: ``results/<platform>/<experiment>/
    <point>.json`` of known experiments only (not checks, logs, CSVs or superseded rows). A file
    this tree lacks is added, unless its bytes are those of a row set aside in ``superseded/``
    (an archive packed before ``supersede`` ran here); one it has is never overwritten: "same"
    when the bytes agree, else "kept" (this tree's row stays; a re-measured point is set aside
    with ``supersede`` first). Members are read one by one, never extracted by their own paths;
    a file in several archives counts once, from the first. Returns the paths (relative to
    ``results_dir``) under "added", "same", "kept" and "superseded"."""
    root = results_root(results_dir)
    known = set(known_experiments())
    found: dict[str, list[str]] = {"added": [], "same": [], "kept": [], "superseded": []}
    seen: set[Path] = set()
    for archive in archives:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if parts[:1] == (".",):
                    parts = parts[1:]
                if not (member.isfile() and len(parts) == 4 and parts[0] == "results" and parts[2] in known
                        and parts[3].endswith(".json") and ".." not in parts):
                    continue
                rel = Path(*parts[1:])
                if rel in seen:
                    continue
                seen.add(rel)
                payload = tar.extractfile(member).read()
                dest = root / rel
                if dest.exists():
                    found["same" if dest.read_bytes() == payload else "kept"].append(str(rel))
                    continue
                set_aside = root / rel.parts[0] / SUPERSEDED / rel.parts[1]
                if any(old.read_bytes() == payload for old in set_aside.glob(f"{dest.stem}.*.json")):
                    found["superseded"].append(str(rel))
                    continue
                found["added"].append(str(rel))
                if not dry_run:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(payload)
    return found
