"""``mambaserve-operator render -f FILE [-f FILE ...]``: every object that InferenceSessions (and the
CacheTiers they name) become, printed offline as YAML documents, like ``helm template``.

For review, GitOps and tests. The input is checked as the API server would check it (defaults, schema
and CEL rules, ``crd_schema.py``), then built by the same builders and settings as the running operator
(its flags are accepted here). An object read from a file has no uid, so its children carry no owner
reference (one naming a uid that does not exist would make the garbage collector delete them); give
``kubectl get isess NAME -o yaml`` as input to get the references the operator writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import yaml

from mambaserve.operator import builders, names
from mambaserve.operator.settings import API_VERSION, OperatorSettings, add_arguments, settings_from
from mambaserve.operator.spec import CacheTier, incompatibilities, parse_cache_tier, parse_session

KINDS = {"InferenceSession": "inferencesessions", "CacheTier": "cachetiers"}
# An installed package carries the CRDs as mambaserve/operator/crds/ (pyproject.toml maps crds/ there);
# a source checkout (or editable install) has them in crds/ beside the operator's folder.
_HERE = pathlib.Path(__file__).resolve().parent
SOURCE_CRDS = next((d for d in (_HERE / "crds", _HERE.parent / "crds") if d.is_dir()), _HERE.parent / "crds")


class RenderError(Exception):
    """Invalid input, in one line that names the file and the object."""


@dataclasses.dataclass(frozen=True)
class Document:
    where: str  # "FILE, document N"
    body: dict[str, Any]

    @property
    def ref(self) -> str:
        meta = self.body.get("metadata") or {}
        return f"{self.body.get('kind')} {meta.get('namespace')}/{meta.get('name')}"


def read_documents(path: str, stdin: TextIO) -> Iterator[Document]:
    """The objects of one file (``-`` reads standard input); a ``List`` contributes its items."""
    try:
        text = stdin.read() if path == "-" else pathlib.Path(path).read_text()
    except OSError as e:
        raise RenderError(f"cannot read {path}: {e.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RenderError(f"{path} is not valid YAML{at}: {problem}") from None
    for i, doc in enumerate(docs, 1):
        where = f"{path}, document {i}"
        if not isinstance(doc, dict):
            raise RenderError(f"{where}: not a Kubernetes object")
        if doc.get("kind") == "List":
            for j, item in enumerate(doc.get("items") or [], 1):
                yield _typed(Document(f"{where}, item {j}", item))
        else:
            yield _typed(Document(where, doc))


def _typed(doc: Document) -> Document:
    if not isinstance(doc.body, dict) or doc.body.get("kind") not in KINDS:
        kind = doc.body.get("kind") if isinstance(doc.body, dict) else None
        raise RenderError(f"{doc.where}: kind {kind!r} is not an InferenceSession or a CacheTier")
    if doc.body.get("apiVersion") != API_VERSION:
        raise RenderError(f"{doc.where}: apiVersion must be {API_VERSION}, not {doc.body.get('apiVersion')!r}")
    if not (doc.body.get("metadata") or {}).get("name"):
        raise RenderError(f"{doc.where}: metadata.name is required")
    return doc


def load_crds(directory: pathlib.Path) -> dict[str, dict[str, Any]]:
    crds = {}
    for kind, plural in KINDS.items():
        path = directory / f"mambaserve.io_{plural}.yaml"
        if not path.is_file():
            raise RenderError(f"the CRD schemas are not in {directory} (no {path.name}); pass --crds DIR "
                              "(crds/ of the source, or of the Helm chart)")
        crds[kind] = yaml.safe_load(path.read_text())
    return crds


def admit(doc: Document, crds: Mapping[str, Any], namespace: str) -> Document:
    """The object as the API server would store it (defaults applied), or a RenderError saying why not."""
    from mambaserve.operator import crd_schema  # jsonschema and cel-python: only this command needs them

    body = dict(doc.body)
    body["metadata"] = {"namespace": namespace, **(body.get("metadata") or {})}
    stored, errors = crd_schema.admit(crds[body["kind"]], body)
    checked = Document(doc.where, stored)
    if errors:
        shown = "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")
        raise RenderError(f"{doc.where}: {checked.ref} is invalid: {shown}")
    return checked


def _without_owner(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].pop("ownerReferences", None)
    return names.stamp(obj)  # the hash describes the object as printed


def render(docs: Sequence[Document], settings: OperatorSettings,
           warn: Any = lambda message: None) -> list[tuple[str, dict[str, Any]]]:
    """(source, object) for every object the admitted documents become, in the operator's apply order."""
    tiers: dict[tuple[str, str], tuple[Document, CacheTier]] = {}
    for doc in docs:
        if doc.body["kind"] == "CacheTier":
            tier = parse_cache_tier(doc.body)
            if (tier.namespace, tier.name) in tiers:
                raise RenderError(f"{doc.where}: {doc.ref} is defined twice")
            tiers[tier.namespace, tier.name] = (doc, tier)
    sessions = [d for d in docs if d.body["kind"] == "InferenceSession"]
    if not sessions:
        raise RenderError("no InferenceSession in the given files")

    out: list[tuple[str, dict[str, Any]]] = []
    for doc, tier in tiers.values():
        claim = builders.build_tier_claim(tier)
        if claim is not None:
            out.append((doc.ref, claim if tier.uid else _without_owner(claim)))
    for doc in sessions:
        session = parse_session(doc.body)
        tier = None
        if session.cache_tier is not None:
            found = tiers.get((session.namespace, session.cache_tier))
            if found is None:
                raise RenderError(f"{doc.where}: {doc.ref} names CacheTier {session.cache_tier}, which no -f file "
                                  f"defines in namespace {session.namespace} (the operator deploys nothing without it)")
            tier = found[1]
            bad = incompatibilities(session, tier)
            if bad:
                raise RenderError(f"{doc.where}: {doc.ref}: " + "; ".join(p.message for p in bad)
                                  + " (the operator deploys nothing while they are incompatible)")
        for problem in builders.problems(session, tier):
            warn(f"{doc.ref}: {problem.message} ({problem.reason})")
        for child in builders.build_session_children(session, tier, settings):
            out.append((doc.ref, child if session.uid else _without_owner(child)))
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's files) as literal blocks, readable in a review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(rendered: Sequence[tuple[str, dict[str, Any]]], stream: TextIO) -> None:
    for i, (source, obj) in enumerate(rendered):
        if i:
            stream.write("---\n")
        stream.write(f"# Source: {source}\n")
        yaml.dump(obj, stream, Dumper=_Dumper, sort_keys=False, width=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mambaserve-operator render",
        description="Print every object InferenceSessions and their CacheTiers become, as YAML, offline. "
                    "The operator's flags set what it would (images, --service-monitors, --monitor-labels, ...).")
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                   help="YAML with InferenceSession and CacheTier objects (repeatable; - reads stdin)")
    p.add_argument("-n", "--default-namespace", default="default", metavar="NS",
                   help="namespace of objects that name none (default: default)")
    p.add_argument("--crds", type=pathlib.Path, default=SOURCE_CRDS, metavar="DIR",
                   help="folder with the mambaserve CRDs (default: those the package ships)")
    add_arguments(p)
    return p


def main(argv: Sequence[str], stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
         stderr: TextIO = sys.stderr) -> int:
    p = parser()
    args = p.parse_args(list(argv))
    settings = settings_from(args, p)
    try:
        crds = load_crds(args.crds)
        docs = [admit(doc, crds, args.default_namespace)
                for path in args.filename for doc in read_documents(path, stdin)]
        rendered = render(docs, settings, warn=lambda m: print(f"{p.prog}: warning: {m}", file=stderr))
    except RenderError as e:
        print(f"{p.prog}: error: {e}", file=stderr)
        return 1
    try:
        dump(rendered, stdout)
        stdout.flush()
    except BrokenPipeError:  # `render ... | head`: the reader has seen enough
        if stdout is sys.stdout:  # keep the interpreter's own flush at exit quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
