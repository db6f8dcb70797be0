"""The in-tree PEP 517 build backend of the ``mooncake`` package (standard library only).

``pip install .`` loads this module from ``build_backend/`` (pyproject.toml: ``backend-path``)
with ``requires = []``, so pip's isolated build environment needs nothing from a package index:
the build works offline with what Debian ships (CMake, Ninja, a C++ compiler, torch, pybind11,
protobuf). It

1. asks the installing interpreter (``sys.executable``, run outside pip's isolation so that it
   sees its own site-packages) for its torch and extension suffix;
2. configures a CMake build directory (``<source>/build`` unless ``-C build-dir=DIR`` says
   otherwise) for that interpreter, or reuses one that is already configured for an interpreter
   with the same torch, and builds only what the wheel ships: ``mooncake_torch`` (the ``_C``
   extension) and ``mooncake_master``;
3. writes the wheel itself: ``torch_ext/python/mooncake/**.py`` from the source tree, ``_C`` and
   ``mooncake_master`` from the build directory (debug info stripped unless ``-C strip=false``),
   metadata from pyproject.toml's ``[project]`` table, and the torch it was built against as an
   exact requirement (the extension is bound to that torch's C++ ABI).

Settings (``pip install . -C key=value``, pip >= 22.1):

    build-dir=DIR     CMake build directory (relative to the source tree or absolute)
    jobs=N            parallel build jobs (default: CMake's/ninja's own default)
    cmake-args=ARGS   extra arguments for the CMake configure step (space separated)
    strip=false       keep debug info in the shipped binaries

Not supported: editable installs (``pip install -e``). See docs/install.md.
"""

import base64
import csv
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG_SRC = os.path.join(SRC, "torch_ext", "python", "mooncake")
MASTER_NAME = "mooncake_master"

# What the installing interpreter has: the wheel's extension must match it.
_PROBE = r"""
import json, os, sys, sysconfig
out = {"python": sys.executable, "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX")}
try:
    import torch
    out["torch_version"] = torch.__version__
    out["torch_dir"] = os.path.dirname(os.path.realpath(torch.__file__))
except Exception as e:  # reported by the backend
    out["torch_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


class BuildError(RuntimeError):
    pass


def _log(msg):
    print(f"mooncake-build: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- pyproject.toml


def _parse_toml_subset(text):
    """Tables, "strings", integers, booleans and one-line arrays of strings: what our
    pyproject.toml uses. Only for Python < 3.11 without tomli."""
    data = {}
    table = data
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"\[([A-Za-z0-9_.\-]+)\]", line)
        if m:
            table = data
            for part in m.group(1).split("."):
                table = table.setdefault(part, {})
            continue
        key, _, value = (s.strip() for s in line.partition("="))
        key = key.strip('"')
        if value.startswith("["):
            table[key] = [v.strip().strip('"') for v in value.strip("[]").split(",") if v.strip()]
        elif value.startswith('"'):
            table[key] = value.strip('"')
        elif value in ("true", "false"):
            table[key] = value == "true"
        else:
            table[key] = int(value)
    return data


def _pyproject():
    path = os.path.join(SRC, "pyproject.toml")
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            tomllib = None
    if tomllib is not None:
        with open(path, "rb") as f:
            return tomllib.load(f)
    with open(path, encoding="utf-8") as f:
        return _parse_toml_subset(f.read())


# ---------------------------------------------------------------- environment and probes


def _clean_env():
    """The environment for CMake and the interpreter probe: pip's isolated build environment
    puts a sitecustomize.py on PYTHONPATH that hides the interpreter's site-packages (and
    torch with them); subprocesses must not inherit it."""
    env = dict(os.environ)
    pp = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in pp if "pip-build-env" not in p]
    if len(kept) != len(pp):
        env.pop("PYTHONNOUSERSITE", None)  # set by pip's isolation, not by the user
        if kept:
            env["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            env.pop("PYTHONPATH", None)
    return env


def _probe(python):
    r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, env=_clean_env(),
                       cwd="/")
    if r.returncode != 0:
        raise BuildError(f"cannot run {python}: {r.stderr.strip()[-2000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    return info


def _probe_installing():
    info = _probe(sys.executable)
    if "torch_version" not in info:
        raise BuildError(
            f"{sys.executable} cannot import torch ({info.get('torch_error')}); the mooncake "
            "package is a torch extension. On Debian: apt install python3-torch, and make a "
            "venv with --system-site-packages so that it sees Debian's torch.")
    return info


def _settings(config_settings):
    s = dict(config_settings or {})
    build_dir = s.get("build-dir") or os.path.join(SRC, "build")
    if not os.path.isabs(build_dir):
        build_dir = os.path.join(SRC, build_dir)
    strip = str(s.get("strip", "true")).lower() not in ("0", "false", "no", "off")
    jobs = s.get("jobs")
    cmake_args = s.get("cmake-args") or ""
    if isinstance(cmake_args, list):
        cmake_args = " ".join(cmake_args)
    return {"build_dir": os.path.abspath(build_dir), "build_dir_given": bool(s.get("build-dir")),
            "strip": strip,
            "jobs": str(jobs) if jobs else None, "cmake_args": shlex.split(cmake_args)}


# ---------------------------------------------------------------- CMake


def _cache_value(build_dir, name):
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return None


def _run(cmd):
    _log("$ " + " ".join(shlex.quote(c) for c in cmd))
    r = subprocess.run(cmd, env=_clean_env(), cwd=SRC)
    if r.returncode != 0:
        raise BuildError(f"command failed (exit {r.returncode}): {' '.join(cmd)}")


def _configured(build_dir):
    return os.path.isfile(os.path.join(build_dir, "CMakeCache.txt"))


def _torch_mismatch(build_dir, info):
    """None when the configured build_dir builds for the installing interpreter's torch, else
    what it was configured for. (A venv's python resolves to the same binary as the system's
    but may see another torch, so the interpreters are compared by what they import.)"""
    if _cache_value(build_dir, "MC_WITH_TORCH") not in ("ON", "TRUE", "1"):
        return None  # no torch configured yet: configuring for this interpreter is safe
    cache_py = _cache_value(build_dir, "MC_PYTHON")
    if cache_py == sys.executable:
        return None
    other = _probe(cache_py) if cache_py and os.path.exists(cache_py) else {}
    if all(other.get(k) == info[k] for k in ("torch_version", "torch_dir", "ext_suffix")):
        return None
    return f"configured for {cache_py} (torch {other.get('torch_version', 'unknown')})"


def _choose_build_dir(settings, info):
    """The build directory to use: the given/default one, unless it is configured for another
    torch. CMake caches the torch it found (library paths), so such a directory is never
    switched over: an explicit build-dir is an error, the default gives way to
    build-<python tag>-torch<version> beside it."""
    bd = settings["build_dir"]
    if not _configured(bd):
        return bd
    why = _torch_mismatch(bd, info)
    if why is None:
        return bd
    if settings["build_dir_given"]:
        raise BuildError(f"{bd} is {why}, not for {sys.executable} (torch "
                         f"{info['torch_version']}); pass another --config-settings build-dir=")
    tag = re.sub(r"[^A-Za-z0-9.]+", "-", f"{_tags()[0]}-torch{info['torch_version']}")
    alt = os.path.join(SRC, f"build-{tag}")
    _log(f"{bd} is {why}; building in {alt} instead")
    if _configured(alt):
        why = _torch_mismatch(alt, info)
        if why is not None:
            raise BuildError(f"{alt} is {why}; pass --config-settings build-dir=")
    return alt


def _cmake_build(settings, info):
    build_dir = settings["build_dir"]
    configured = _configured(build_dir)
    reason = None
    if not configured:
        reason = "new build directory"
    elif _cache_value(build_dir, "MC_WITH_TORCH") not in ("ON", "TRUE", "1"):
        reason = "configured without torch"
    elif settings["cmake_args"]:
        reason = "cmake-args given"
    if reason is not None:
        _log(f"configuring {build_dir} ({reason})")
        cmd = ["cmake", "-S", SRC, "-B", build_dir, "-DMC_PYTHON=" + sys.executable,
               "-DMC_WITH_TORCH=ON"]
        if not configured:
            cmd += ["-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles",
                    "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
        _run(cmd + settings["cmake_args"])
    else:
        _log(f"reusing {build_dir} (configured for a Python with torch {info['torch_version']})")
    cmd = ["cmake", "--build", build_dir, "--target", "mooncake_torch", MASTER_NAME]
    if settings["jobs"]:
        cmd += ["-j", settings["jobs"]]
    _run(cmd)


def _elf_runpaths(path):
    readelf = shutil.which("readelf")
    if readelf is None:
        return []
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True).stdout
    paths = []
    for m in re.finditer(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[(.*)\]", out):
        paths += [p for p in m.group(1).split(":") if p]
    return paths


def _built_files(settings, info):
    """(arcname, path on disk, executable) of the binaries the wheel ships."""
    build_dir = settings["build_dir"]
    ext = os.path.join(build_dir, "python", "mooncake", "_C" + info["ext_suffix"])
    master = os.path.join(build_dir, "store", MASTER_NAME)
    for p in (ext, master):
        if not os.path.isfile(p):
            raise BuildError(f"{p} was not built (is {build_dir} a build of this tree?)")
    for p in (ext, master):
        for rp in _elf_runpaths(p):
            real = os.path.realpath(rp)
            if real.startswith(os.path.realpath(build_dir)) or real.startswith(SRC + os.sep):
                raise BuildError(f"{p} has RUNPATH {rp} inside the build tree; the installed "
                                 "copy would depend on this checkout")
    return [("mooncake/_C" + info["ext_suffix"], ext, False),
            ("mooncake/" + MASTER_NAME, master, True)]


# ---------------------------------------------------------------- fingerprint


def fingerprint(build_dir, ext_suffix):
    """sha256 over everything a wheel is made of: the backend, pyproject.toml, the package's
    .py files and the two built binaries. Recorded in the wheel (dist-info/mooncake_build.json)
    so that scripts/install_python.sh can tell an up-to-date install from a stale one."""
    h = hashlib.sha256()
    files = [os.path.join(SRC, "pyproject.toml"), os.path.abspath(__file__)]
    files += [p for _, p in _python_files()]
    files += [os.path.join(build_dir, "python", "mooncake", "_C" + ext_suffix),
              os.path.join(build_dir, "store", MASTER_NAME)]
    for p in files:
        h.update(os.path.relpath(p, SRC).encode() + b"\0")
        try:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()


# ---------------------------------------------------------------- metadata


def _tags():
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name[:2]
    ver = f"{sys.version_info.major}{sys.version_info.minor}"
    abiflags = getattr(sys, "abiflags", "")
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{impl}{ver}", f"{impl}{ver}{abiflags}", plat


def _metadata(info):
    proj = _pyproject()["project"]
    lines = ["Metadata-Version: 2.1", f"Name: {proj['name']}", f"Version: {proj['version']}"]
    if proj.get("description"):
        lines.append(f"Summary: {proj['description']}")
    if proj.get("requires-python"):
        lines.append(f"Requires-Python: {proj['requires-python']}")
    # The extension is compiled against this exact torch (C++ ABI): say so to pip.
    lines.append(f"Requires-Dist: torch=={info['torch_version']}")
    for dep in proj.get("dependencies", []):
        lines.append(f"Requires-Dist: {dep}")
    for extra, deps in proj.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for dep in deps:
            lines.append(f'Requires-Dist: {dep}; extra == "{extra}"')
    readme = proj.get("readme")
    body = ""
    if isinstance(readme, str) and os.path.isfile(os.path.join(SRC, readme)):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(SRC, readme), encoding="utf-8") as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


def _entry_points():
    scripts = _pyproject()["project"].get("scripts", {})
    if not scripts:
        return ""
    return "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())


def _wheel_file():
    py, abi, plat = _tags()
    return (f"Wheel-Version: 1.0\nGenerator: mooncake_build\nRoot-Is-Purelib: false\n"
            f"Tag: {py}-{abi}-{plat}\n")


def _dist_info_name():
    proj = _pyproject()["project"]
    return f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"


def _dist_info_files(info):
    return {
        "METADATA": _metadata(info),
        "WHEEL": _wheel_file(),
        "entry_points.txt": _entry_points(),
        "top_level.txt": "mooncake\n",
    }


# ---------------------------------------------------------------- PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = _probe_installing()
    name = _dist_info_name()
    d = os.path.join(metadata_directory, name)
    os.makedirs(d, exist_ok=True)
    for fname, text in _dist_info_files(info).items():
        with open(os.path.join(d, fname), "w", encoding="utf-8") as f:
            f.write(text)
    return name


def _python_files():
    out = []
    for root, dirs, files in os.walk(PKG_SRC):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                out.append(("mooncake/" + os.path.relpath(path, PKG_SRC).replace(os.sep, "/"),
                            path))
    return out


def _record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _zip_add(zf, arcname, data, executable=False):
    zi = zipfile.ZipInfo(arcname, date_time=time.localtime(
        int(os.environ.get("SOURCE_DATE_EPOCH", time.time())))[:6])
    zi.compress_type = zipfile.ZIP_DEFLATED
    zi.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
    zf.writestr(zi, data, compresslevel=6)


def _binary_bytes(path, strip):
    if strip and shutil.which("strip"):
        with tempfile.TemporaryDirectory() as td:
            tmp = os.path.join(td, os.path.basename(path))
            r = subprocess.run(["strip", "--strip-debug", "-o", tmp, path], capture_output=True,
                               text=True)
            if r.returncode == 0:
                with open(tmp, "rb") as f:
                    return f.read()
            _log(f"strip failed on {path} ({r.stderr.strip()}); shipping it unstripped")
    with open(path, "rb") as f:
        return f.read()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    t0 = time.time()
    settings = _settings(config_settings)
    info = _probe_installing()
    _log(f"python {sys.executable}, torch {info['torch_version']} ({info['torch_dir']})")
    settings["build_dir"] = _choose_build_dir(settings, info)
    _cmake_build(settings, info)
    binaries = _built_files(settings, info)

    proj = _pyproject()["project"]
    py, abi, plat = _tags()
    wheel_name = f"{proj['name'].replace('-', '_')}-{proj['version']}-{py}-{abi}-{plat}.whl"
    dist_info = _dist_info_name()
    os.makedirs(wheel_directory, exist_ok=True)
    path = os.path.join(wheel_directory, wheel_name)
    records = []
    with zipfile.ZipFile(path, "w") as zf:
        def add(arcname, data, executable=False):
            _zip_add(zf, arcname, data, executable)
            records.append((arcname, _record_hash(data), str(len(data))))

        for arcname, src in _python_files():
            with open(src, "rb") as f:
                add(arcname, f.read())
        for arcname, src, executable in binaries:
            add(arcname, _binary_bytes(src, settings["strip"]), executable)
        for fname, text in _dist_info_files(info).items():
            add(f"{dist_info}/{fname}", text.encode())
        build_info = {"fingerprint": fingerprint(settings["build_dir"], info["ext_suffix"]),
                      "source_dir": SRC, "build_dir": settings["build_dir"],
                      "torch_version": info["torch_version"], "stripped": settings["strip"]}
        add(f"{dist_info}/mooncake_build.json", (json.dumps(build_info, indent=1) + "\n").encode())
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerows(records)
        w.writerow((f"{dist_info}/RECORD", "", ""))
        _zip_add(zf, f"{dist_info}/RECORD", buf.getvalue().encode())
    _log(f"wrote {wheel_name} ({os.path.getsize(path) >> 10} KiB) in {time.time() - t0:.1f} s")
    return wheel_name


def _sdist_files():
    if os.path.isdir(os.path.join(SRC, ".git")) or os.path.isfile(os.path.join(SRC, ".git")):
        r = subprocess.run(["git", "-C", SRC, "ls-files", "-z"], capture_output=True)
        if r.returncode == 0:
            return sorted(p for p in r.stdout.decode().split("\0")
                          if p and os.path.isfile(os.path.join(SRC, p)))
    out = []
    for root, dirs, files in os.walk(SRC):
        rel_root = os.path.relpath(root, SRC)
        skip = lambda d: (d.startswith(".") or d == "__pycache__"
                          or (d.startswith("build") and d != "build_backend"))
        dirs[:] = [d for d in dirs if not skip(d)]
        out += [os.path.normpath(os.path.join(rel_root, f)) for f in files
                if not f.endswith(".pyc")]
    return sorted(out)


def build_sdist(sdist_directory, config_settings=None):
    proj = _pyproject()["project"]
    base = f"{proj['name'].replace('-', '_')}-{proj['version']}"
    os.makedirs(sdist_directory, exist_ok=True)
    path = os.path.join(sdist_directory, base + ".tar.gz")
    pkg_info = "\n".join(["Metadata-Version: 2.1", f"Name: {proj['name']}",
                          f"Version: {proj['version']}"]) + "\n"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        for rel in _sdist_files():
            tf.add(os.path.join(SRC, rel), arcname=f"{base}/{rel}", recursive=False)
        data = pkg_info.encode()
        ti = tarfile.TarInfo(f"{base}/PKG-INFO")
        ti.size = len(data)
        ti.mtime = int(time.time())
        tf.addfile(ti, io.BytesIO(data))
    return base + ".tar.gz"


if __name__ == "__main__":
    # python3 build_backend/mooncake_build.py fingerprint BUILD_DIR: the fingerprint a wheel
    # built now from BUILD_DIR by this interpreter would record (scripts/install_python.sh).
    if len(sys.argv) == 3 and sys.argv[1] == "fingerprint":
        print(fingerprint(os.path.abspath(sys.argv[2]), sysconfig.get_config_var("EXT_SUFFIX")))
        sys.exit(0)
    sys.exit("usage: mooncake_build.py fingerprint BUILD_DIR")
