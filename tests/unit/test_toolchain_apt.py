"""project.apt's pure pieces (runner/toolchain/apt.py): the package-name check, the parse
of apt's ``--print-uris`` and ``apt-cache show`` output (captured from apt 2.6 on Debian
12 against the analyst image's status), and the private sources."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.toolchain.apt import (
    check_apt_names,
    debs_of,
    parse_print_uris,
    parse_show,
    sources_list,
)

# apt-get install --print-uris -qq nodejs (two of its ten lines): apt prints the MD5 for a
# main-archive .deb and nothing at all for a security one
PRINT_URIS = (
    "'http://deb.debian.org/debian/pool/main/c/c-ares/libc-ares2_1.18.1-3_amd64.deb' "
    "libc-ares2_1.18.1-3_amd64.deb 102484 MD5Sum:a56844c6332cb330f8920e62ea41fac9\n"
    "'http://deb.debian.org/debian-security/pool/updates/main/n/nodejs/"
    "nodejs_18.20.4%2bdfsg-1%7edeb12u3_amd64.deb' nodejs_18.20.4+dfsg-1~deb12u3_amd64.deb "
    "322140 \n"
)
SHOW = """Package: nodejs
Version: 18.20.4+dfsg-1~deb12u3
Description: evented I/O for V8 javascript - runtime executable
Filename: pool/updates/main/n/nodejs/nodejs_18.20.4+dfsg-1~deb12u3_amd64.deb
Size: 322140
SHA256: 97d0944c0da81b0acd4c6d58e7d5a2894f89aa66067400a86c9ecb0b76969ecc
Description-md5: 1b4f3e0e0b8a4e0d0c1b5d0f4d2f3b8a
 a continuation line: ignored

Package: libc-ares2
Version: 1.18.1-3
Filename: pool/main/c/c-ares/libc-ares2_1.18.1-3_amd64.deb
Size: 102484
MD5sum: a56844c6332cb330f8920e62ea41fac9
SHA256: 087fd5c2ac883202e1786ab45617cdab7f77bc7f060d58cca177ddf6b6c3fa73
"""


def test_print_uris_and_show_give_each_deb_with_its_sha256() -> None:
    debs = debs_of(PRINT_URIS, SHOW)
    assert [(d.pin, d.arch, d.filename, d.size) for d in debs] == [
        ("libc-ares2=1.18.1-3", "amd64", "libc-ares2_1.18.1-3_amd64.deb", 102484),
        ("nodejs=18.20.4+dfsg-1~deb12u3", "amd64", "nodejs_18.20.4+dfsg-1~deb12u3_amd64.deb",
         322140)]
    assert debs[1].sha256.startswith("97d0944c0da8")
    assert debs[1].url.startswith("http://deb.debian.org/debian-security/")


def test_a_deb_the_lists_give_no_sha256_for_is_refused() -> None:
    show = SHOW.replace("SHA256: 087fd5c2ac883202e1786ab45617cdab7f77bc7f060d58cca177ddf6b6c3fa73",
                        "")
    with pytest.raises(ConfigError, match=r"no SHA256 for libc-ares2=1\.18\.1-3"):
        debs_of(PRINT_URIS, show)


def test_other_lines_are_not_debs() -> None:
    assert parse_print_uris("Reading package lists...\nW: something\n") == []
    assert parse_show("Package: x\nVersion: 1\nSHA256: nothex\n") == {}


@pytest.mark.parametrize("name", ["nodejs", "npm", "libstdc++6", "python3.11",
                                  "nodejs=18.20.4+dfsg-1~deb12u3", "g++=4:12.2.0-3"])
def test_plain_debian_names_pass(name: str) -> None:
    assert check_apt_names((name,), path="cycle.yaml") == (name,)


@pytest.mark.parametrize("name", ["-oAPT::Get::AllowUnauthenticated=1", "--allow-downgrades",
                                  "./evil.deb", "/tmp/x.deb", "http://x/y.deb", "NodeJS",
                                  "nodejs;id", "a b", "", "nodejs=", "x\x1b[2J"])
def test_options_paths_and_urls_are_not_package_names(name: str) -> None:
    with pytest.raises(ConfigError, match=r"cycle\.yaml: project\.apt: .* is not a Debian "
                                          r"package name"):
        check_apt_names((name,), path="cycle.yaml")


def test_names_are_sorted_and_duplicates_refused() -> None:
    assert check_apt_names(("npm", "nodejs"), path="c") == ("nodejs", "npm")
    with pytest.raises(ConfigError, match="listed twice"):
        check_apt_names(("nodejs", "nodejs"), path="c")


def test_the_private_sources_are_the_base_images_suite_with_its_fixes() -> None:
    assert sources_list("http://m/debian", "http://m/debian-security") == (
        "deb http://m/debian bookworm main\n"
        "deb http://m/debian bookworm-updates main\n"
        "deb http://m/debian-security bookworm-security main\n")


# -- the resolve step over a scripted apt (helper-43 #3, #4) -----------------------------

STATUS = b"""Package: libc6
Status: install ok installed
Version: 2.36-9

Package: oldpkg
Status: deinstall ok config-files
Version: 1
"""


def _uris(*debs: tuple[str, int]) -> tuple[str, str]:
    uris, show = [], []
    for name, size in debs:
        uris.append(f"'http://deb.debian.org/debian/pool/main/x/{name}/{name}_1.0_amd64.deb' "
                    f"{name}_1.0_amd64.deb {size} MD5Sum:00\n")
        show.append(f"Package: {name}\nVersion: 1.0\nSHA256: {'a' * 64}\n")
    return "".join(uris), "\n".join(show)


def _resolver(tmp_path, monkeypatch, print_uris: str, show: str):  # type: ignore[no-untyped-def]
    import subprocess

    from runner.toolchain.apt import AptResolver

    r = AptResolver(tmp_path / "apt", STATUS)
    (tmp_path / "apt" / "lists" / ".updated").touch()  # fresh lists: no apt-get update

    def fake_apt(self, *args, tool="apt-get", archives=None):  # type: ignore[no-untyped-def]
        out = show if tool == "apt-cache" else print_uris
        return subprocess.CompletedProcess([tool, *args], 0, out, "")

    monkeypatch.setattr(AptResolver, "_apt", fake_apt)
    return r


def test_a_name_apt_reads_as_a_pattern_is_refused(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`fonts-noto-c.+` is no package: apt installs every package the regex matches."""
    r = _resolver(tmp_path, monkeypatch, *_uris(("fonts-noto-cjk", 10), ("fonts-noto-core", 10)))
    with pytest.raises(ConfigError, match=r"fonts-noto-c\.\+.*exact") as e:
        r.resolve(("fonts-noto-c.+",), path="cycle.yaml")
    assert e.value.field == "project.apt" and "cycle.yaml" in str(e.value)
    # an exact name passes, and so does one the image has installed (nothing to fetch)
    assert [d.package for d in r.resolve(("fonts-noto-cjk", "libc6"), path="c")] == [
        "fonts-noto-cjk", "fonts-noto-core"]
    with pytest.raises(ConfigError, match="oldpkg"):  # only config files left: not installed
        r.resolve(("oldpkg",), path="c")


def test_the_resolved_debs_are_capped_in_count_and_bytes(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from runner.toolchain import apt

    monkeypatch.setattr(apt, "MAX_APT_DEBS", 3, raising=False)
    monkeypatch.setattr(apt, "MAX_APT_BYTES", 1000, raising=False)
    r = _resolver(tmp_path / "a", monkeypatch, *_uris(*((f"p{i}", 10) for i in range(4))))
    with pytest.raises(ConfigError, match=r"4 \.debs.*at most 3") as e:
        r.resolve(("p0",), path="cycle.yaml")
    assert e.value.field == "project.apt"
    r = _resolver(tmp_path / "b", monkeypatch, *_uris(("big", 600), ("bigger", 600)))
    with pytest.raises(ConfigError, match=r"2 \.debs"):
        r.resolve(("big",), path="cycle.yaml")
    r = _resolver(tmp_path / "c", monkeypatch, *_uris(("small", 600), ("other", 300)))
    assert len(r.resolve(("small",), path="cycle.yaml")) == 2


def test_debs_are_copied_and_hashed_in_chunks(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import hashlib
    import subprocess

    from runner.toolchain.apt import AptDeb, AptResolver

    data = bytes(range(256)) * 20000  # 5 MB
    r = AptResolver(tmp_path / "apt", STATUS)
    (tmp_path / "apt" / "archives" / "x_1_amd64.deb").write_bytes(data)
    monkeypatch.setattr(AptResolver, "_apt", lambda self, *a, **k: subprocess.CompletedProcess(
        a, 0, "", ""))
    from pathlib import Path

    real = Path.read_bytes

    def whole(self: Path) -> bytes:  # a .deb is never read whole into memory
        assert not self.name.endswith(".deb"), self
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", whole)
    deb = AptDeb("x", "1", "amd64", "u", "x_1_amd64.deb", len(data),
                 hashlib.sha256(data).hexdigest())
    r.download(("x",), [deb], tmp_path / "out")
    monkeypatch.undo()
    assert (tmp_path / "out" / "x_1_amd64.deb").read_bytes() == data
