"""Role image inputs: one Dockerfile, per-role data in images/roles.yaml, and a tag hash
that covers only what each role copies in (no Docker needed)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import yaml

from runner.errors import ConfigError
from runner.isolation.docker import images as img
from runner.isolation.policy import ROLES
from runner.paths import images_dir, sandbox_src

ENTRY_MODULES = {
    "analyst": ["sandbox.probe", "sandbox.gateway_client"],  # agents import the client
    "worker": ["sandbox.worker", "sandbox.relay"],
    "evaluator": ["sandbox.evaluator"],
    "apply": ["sandbox.apply_main"],
    "trainer": ["sandbox.probe", "sandbox.train.tiny", "sandbox.train.proof",
                "sandbox.train.verify_adapter", "sandbox.train.sft", "sandbox.train.bench"],
}
"""The modules runner/ (and project agents) run or import in each role's container."""


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of images/ and sandbox/ to edit."""
    images, sandbox = tmp_path / "images", tmp_path / "sandbox"
    shutil.copytree(images_dir(), images)
    shutil.copytree(sandbox_src(), sandbox,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return images, sandbox


def _hashes(images: Path, sandbox: Path, digest: str = "w") -> dict[str, str]:
    inputs = img.load_inputs(images)
    return {r: img.input_hash(r, "sha256:base", digest, inputs=inputs, images=images,
                              sandbox=sandbox) for r in ROLES}


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {r for r in ROLES if before[r] != after[r]}


def _append(path: Path, text: str = "\n# edited\n") -> None:
    path.write_text(path.read_text() + text)


def test_editing_training_code_changes_only_the_trainer_tag(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    before = _hashes(images, sandbox)
    _append(sandbox / "train" / "lora.py")
    assert _changed(before, _hashes(images, sandbox)) == {"trainer"}


def test_editing_the_evaluator_leaves_the_trainer_tag(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    before = _hashes(images, sandbox)
    _append(sandbox / "evaluator.py")
    changed = _changed(before, _hashes(images, sandbox))
    assert "trainer" not in changed
    assert "evaluator" in changed


def test_a_new_training_data_file_changes_only_the_trainer_tag(
        tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    before = _hashes(images, sandbox)
    (sandbox / "train" / "extra.txt").write_text("more corpus\n")
    assert _changed(before, _hashes(images, sandbox)) == {"trainer"}


def test_host_only_holder_and_bytecode_change_no_tag(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    before = _hashes(images, sandbox)
    _append(sandbox / "holder.py")
    (sandbox / "__pycache__").mkdir(exist_ok=True)
    (sandbox / "__pycache__" / "probe.cpython-311.pyc").write_bytes(b"junk")
    assert _changed(before, _hashes(images, sandbox)) == set()


def test_shared_and_per_role_inputs(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    before = _hashes(images, sandbox)
    _append(images / "trainer" / "requirements.txt")
    after = _hashes(images, sandbox)
    assert _changed(before, after) == {"trainer"}
    _append(images / "Dockerfile")
    assert _changed(after, _hashes(images, sandbox)) == set(ROLES)
    assert _changed(before, _hashes(images, sandbox, digest="other wheels")) == set(ROLES)
    assert len(set(before.values())) == len(ROLES), "roles with equal inputs still differ"


def test_one_roles_entry_changes_only_that_role(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    before = _hashes(images, sandbox)
    data = yaml.safe_load((images / "roles.yaml").read_text())
    data["roles"]["apply"]["sandbox"] = ["__init__.py", "py.typed", "probe.py", "apply.py",
                                         "apply_main.py", "proposal.py"]
    (images / "roles.yaml").write_text(yaml.safe_dump(data))
    assert _changed(before, _hashes(images, sandbox)) == {"apply"}


def _sandbox_imports(path: Path) -> set[str]:
    """``sandbox.*`` modules a file imports (at any depth, including function bodies)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "sandbox"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "sandbox":
            out.add(node.module)
            # `from sandbox.train import lora` imports the submodule sandbox.train.lora
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _module_files(module: str, root: Path) -> list[Path]:
    """Source files that importing ``module`` executes: each package's __init__.py and the
    module file; trailing names that are attributes (``sandbox.proposal.Change``) stop it."""
    here, need = root, [root / "__init__.py"]
    for part in module.split(".")[1:]:
        if (here / part).is_dir():
            here = here / part
            need.append(here / "__init__.py")
        else:
            if (here / f"{part}.py").is_file():
                need.append(here / f"{part}.py")
            break
    return need


@pytest.mark.parametrize("role", ROLES)
def test_each_role_copies_what_its_modules_import(role: str) -> None:
    inputs = img.load_inputs()
    root = sandbox_src()
    copied = set(img.role_files(role, inputs))
    todo = list(ENTRY_MODULES[role])
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for f in _module_files(module, root):
            if f.suffix != ".py" or not f.is_file():
                continue
            assert f in copied, (f"the {role} image runs {module}, which needs "
                                 f"{f.relative_to(root)}; add it to images/roles.yaml")
            todo += sorted(_sandbox_imports(f))


def test_every_sandbox_file_reaches_some_image_or_is_host_only() -> None:
    inputs = img.load_inputs()
    root = sandbox_src()
    copied = {f for r in ROLES for f in img.role_files(r, inputs)}
    every = {p for p in root.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    host_only = {root / n for n in inputs.host_only}
    assert every - copied == host_only
    assert not (copied & host_only)


def test_holder_is_host_supplied_not_imported_from_images(tmp_path: Path) -> None:
    import importlib.util
    import marshal

    from runner.isolation.docker.hardening import (
        HOLDER_MOUNT,
        holder_argv,
        write_holder_files,
    )

    argv = holder_argv("hold", "-")
    assert argv[:4] == ["python3", "-I", "-S", "-c"] and argv[5:] == ["hold", "-"]
    assert repr(HOLDER_MOUNT) in argv[4] and len(argv[4]) < 1024  # no code in the config
    d = write_holder_files(tmp_path / "h")
    source = (sandbox_src() / "holder.py").read_bytes()
    assert (d / "holder.py").read_bytes() == source
    # the bytecode the boot program prefers is the host's compile of that same source
    blob = (d / f"{importlib.util.MAGIC_NUMBER.hex()}.code").read_bytes()
    assert marshal.loads(blob) == compile(source, "<holder>", "exec")  # noqa: S302 - ours
    for f in d.iterdir():
        assert f.stat().st_mode & 0o777 == 0o444
    assert d.stat().st_mode & 0o777 == 0o755
    assert "holder.py" in img.load_inputs().host_only


def test_the_holder_boot_runs_the_source_when_the_bytecode_cannot_be_read(
        tmp_path: Path) -> None:
    """Another Python's magic number (no file of its name), or a blob that does not load:
    the source is compiled in the container instead, and the holder's argv is the same
    either way."""
    import importlib.util
    import subprocess
    import sys

    from runner.isolation.docker.hardening import holder_argv

    probe = b"import sys; print(sys.argv)"
    magic = importlib.util.MAGIC_NUMBER.hex()
    for name, blob in (("ffff0d0a", b"not read"), (magic, b"AAAA")):
        d = tmp_path / name
        d.mkdir()
        (d / "holder.py").write_bytes(probe)
        (d / f"{name}.code").write_bytes(blob)
        argv = holder_argv("x", "y", where=str(d))
        argv[0] = sys.executable
        out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
        assert out.stdout.strip() == "['-c', 'x', 'y']", out
    # and the bytecode, when it loads, is what runs
    d = tmp_path / "ok"
    d.mkdir()
    (d / "holder.py").write_bytes(b"print('source')")
    import marshal
    (d / f"{magic}.code").write_bytes(marshal.dumps(compile("print('code')", "<h>", "exec")))
    argv = holder_argv(where=str(d))
    argv[0] = sys.executable
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == "code", out


def test_one_dockerfile_takes_the_role_as_a_build_argument() -> None:
    text = (images_dir() / "Dockerfile").read_text()
    assert "ARG ROLE" in text and "ARG BASE_IMAGE" in text
    assert not list(images_dir().glob("*/Dockerfile"))


def _write(images: Path, data: dict[str, object]) -> None:
    (images / "roles.yaml").write_text(yaml.safe_dump(data))


def _data(images: Path) -> dict[str, dict[str, dict[str, object]]]:
    out: dict[str, dict[str, dict[str, object]]] = yaml.safe_load(
        (images / "roles.yaml").read_text())
    return out


def test_a_missing_role_is_named(tree: tuple[Path, Path]) -> None:
    images, _ = tree
    data = _data(images)
    del data["roles"]["worker"]
    _write(images, data)
    with pytest.raises(ConfigError, match=r"roles\.yaml: roles: .*missing \['worker'\]"):
        img.load_inputs(images)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("sandbox", ["/etc/passwd"], r"roles\.trainer\.sandbox\[0\].*absolute"),
    ("sandbox", ["../runner/*.py"], r"roles\.trainer\.sandbox\[0\].*escapes"),
    ("requirements", "../../etc/passwd", r"roles\.trainer\.requirements.*escapes"),
    ("sandbox", [], r"roles\.trainer\.sandbox.*at least 1"),
    ("copy", ["x"], r"roles\.trainer\.copy.*Extra inputs"),
])
def test_bad_role_entries_name_the_field(tree: tuple[Path, Path], field: str, value: object,
                                         words: str) -> None:
    images, _ = tree
    data = _data(images)
    data["roles"]["trainer"][field] = value
    _write(images, data)
    with pytest.raises(ConfigError, match=words):
        img.load_inputs(images)


def test_a_pattern_that_matches_nothing_is_named(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    data = _data(images)
    data["roles"]["trainer"]["sandbox"] = ["__init__.py", "trian/**/*"]
    _write(images, data)
    inputs = img.load_inputs(images)
    with pytest.raises(ConfigError, match=r"roles\.trainer\.sandbox\[1\].*matches no file"):
        img.role_files("trainer", inputs, sandbox)


def test_a_missing_requirements_file_is_named(tree: tuple[Path, Path]) -> None:
    images, sandbox = tree
    (images / "apply" / "requirements.txt").unlink()
    with pytest.raises(ConfigError, match=r"roles\.apply\.requirements.*does not exist"):
        img.input_hash("apply", "b", "w", images=images, sandbox=sandbox)


def test_a_wheel_not_pinned_to_its_version_is_named() -> None:
    """CI, 2026-12-04: the role images pinned only their top packages; httpcore2 2.17.0
    came out, the analyst image changed under every agent's pinned requirements."""
    from runner.isolation.docker.images import unpinned_wheels

    req = ("# c\ntorch==2.13.0\nFoo_Bar[x] == 1.0 ; python_version >= '3'\nexact===2\n"
           "loose>=1\n")
    wheels = ["torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", "foo.bar-1.0-py3-none-any.whl",
              "exact-2-py3-none-any.whl", "loose-1.5-py3-none-any.whl",
              "new_dep-0.1-py3-none-any.whl", "torch-2.13.1-cp311-cp311-linux_x86_64.whl"]
    assert unpinned_wheels(req, wheels) == ["loose==1.5", "new-dep==0.1", "torch==2.13.1"]
    assert unpinned_wheels(req, wheels[:3]) == []


def test_a_role_image_is_not_built_from_an_unpinned_wheel(tmp_path, monkeypatch) -> None:
    from runner.errors import ConfigError
    from runner.isolation.docker import images

    wdir = tmp_path / "wheels"
    wdir.mkdir()
    for name in ("openai-3.57.0-py3-none-any.whl", "httpcore2-2.17.0-py3-none-any.whl"):
        (wdir / name).write_bytes(b"")
    monkeypatch.setattr(images, "download_wheels", lambda *a, **k: wdir)
    req = tmp_path / "requirements.txt"
    req.write_text("openai==3.57.0\n")
    monkeypatch.setattr(images, "requirements_file", lambda role, inputs: req)
    with pytest.raises(ConfigError) as err:
        images.ensure_wheels("worker", print, inputs=object())
    assert err.value.field == "httpcore2" and "add httpcore2==2.17.0" in str(err.value)
    req.write_text("openai==3.57.0\nhttpcore2==2.17.0\n")
    assert images.ensure_wheels("worker", print, inputs=object()) == wdir
