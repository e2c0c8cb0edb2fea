"""Build the long-document data set: a folder-per-class tree of text files.

Default source: the Linux kernel documentation shipped by Debian's ``linux-doc-6.1`` package. Every
reStructuredText file under ``Documentation/`` is one document, labelled by its top-level folder:

* folders that are not prose are left out (device-tree YAML, ABI, translations, features, ...),
  and so are the ``index.rst`` files (they are tables of contents);
* the per-architecture folders (``x86``, ``arm64``, ``powerpc``, ... and ``arch``) merge into one
  class ``arch``;
* classes with fewer than ``--min-docs`` documents (default 20) are dropped.

The result follows the ``keras.utils.text_dataset_from_directory`` convention::

    DATA_DIR/<class>/<document>.txt

so ``train.py --data-dir`` accepts this tree or any tree of your own documents in the same layout.

Where the package is installed, its files are read from ``/usr/share/doc/linux-doc-6.1``. Where it
is not (or where ``/usr/share/doc`` is filtered, as in slim Docker images), the ``.deb`` is fetched
with ``apt-get download`` (no root needed) and unpacked with ``dpkg -x``. Nothing else is fetched.

Two small sources need nothing fetched, for trying the example on a few hundred documents:

* ``--source licenses``: the licence texts on this machine, labelled by licence family (apache, bsd,
  gpl, mit, ...): Debian's machine-readable ``/usr/share/doc/<package>/copyright`` files, by the
  licence of their ``Files: *`` paragraph, and the licence files of the installed Python
  distributions (this interpreter's and ``/usr/lib/python3/dist-packages``), by the licence their
  metadata declares (``License-Expression``, the ``License ::`` classifiers, a short ``License``
  field). Documents with several licence families, none, and exact duplicates are left out. What is
  installed decides the size: about 400 documents in four classes on a Debian machine with a
  Python virtualenv, a few dozen where ``/usr/share/doc`` is filtered.
* ``--source licensedcode``: the license texts of the ``licensedcode-data`` package
  (``pip install licensedcode-data``), labelled by license category.

Usage::

    python examples/long_document/prepare_data.py                  # -> data/linux-doc
    python examples/long_document/prepare_data.py --out /tmp/docs --min-docs 30
    python examples/long_document/prepare_data.py --source licenses        # -> data/licenses
"""
import argparse
import collections
import glob
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import cli  # noqa: E402
DEFAULT_PACKAGE = "linux-doc-6.1"

# Top-level folders of Documentation/ that are not prose documents.
EXCLUDED_FOLDERS = frozenset({
    "ABI",           # one-line sysfs attribute records
    "devicetree",    # YAML bindings (the few .rst files are about the YAML)
    "translations",  # the same documents in other languages
    "features",      # per-arch feature tables
    "sphinx", "sphinx-static", "images", "output", "netlink",
})

# Kernel architecture names (the kernel's arch/ directory); their documentation folders merge
# into one class. Newer kernels keep them under Documentation/arch/ instead.
ARCH_FOLDERS = frozenset({
    "arch", "alpha", "arc", "arm", "arm64", "csky", "hexagon", "ia64", "loongarch", "m68k",
    "microblaze", "mips", "nios2", "openrisc", "parisc", "powerpc", "riscv", "s390", "sh",
    "sparc", "um", "x86", "xtensa",
})


def find_documentation(package, doc_root=None):
    """Returns the path of the package's Documentation/ directory, unpacking the .deb if needed."""
    if doc_root:
        if not os.path.isdir(doc_root):
            raise FileNotFoundError(f"--doc-root is not a directory. Received: doc_root={doc_root!r}")
        return doc_root
    installed = f"/usr/share/doc/{package}/Documentation"
    if os.path.isdir(installed) and glob.glob(os.path.join(installed, "*", "*.rst*")):
        return installed
    cache = os.path.join(REPO_ROOT, "data", "deb", package)
    unpacked = os.path.join(cache, "usr", "share", "doc", package, "Documentation")
    if os.path.isdir(unpacked):
        return unpacked
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError(
            f"{installed} is missing and apt-get/dpkg are not available to fetch {package}. "
            "Install the package, or pass --doc-root, or use --data-dir with your own documents.")
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{installed} not found: apt-get download {package}", flush=True)
        subprocess.run(["apt-get", "download", package], cwd=tmp, check=True)
        debs = glob.glob(os.path.join(tmp, "*.deb"))
        if not debs:
            raise RuntimeError(f"apt-get download {package} produced no .deb in {tmp}")
        subprocess.run(["dpkg", "-x", debs[0], cache], check=True)
    if not os.path.isdir(unpacked):
        raise RuntimeError(f"the {package} .deb has no {unpacked}")
    return unpacked


def read_text(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def collect_linux_doc(doc_root):
    """Returns {class: [(doc_name, path)]} and the list of merged architecture folders."""
    by_class = collections.defaultdict(list)
    merged = set()
    for top in sorted(os.listdir(doc_root)):
        folder = os.path.join(doc_root, top)
        if not os.path.isdir(folder) or top in EXCLUDED_FOLDERS:
            continue
        label = "arch" if top in ARCH_FOLDERS else top
        for dirpath, _, files in os.walk(folder):
            for name in sorted(files):
                if not (name.endswith(".rst") or name.endswith(".rst.gz")):
                    continue
                if name.startswith("index.rst"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), doc_root)
                doc_name = rel.replace(".rst.gz", "").replace(".rst", "").replace(os.sep, "__")
                by_class[label].append((doc_name, os.path.join(dirpath, name)))
                if label == "arch":
                    merged.add(top)
    return by_class, sorted(merged)


def collect_licensedcode():
    """License texts of the pip package licensedcode-data, labelled by license category.

    Each ``licensedcode/data/licenses/<key>.LICENSE`` holds a YAML header (``category: Permissive``,
    ...) between ``---`` lines and then the license text; the header is dropped (it names the class).
    Returns {class: [(doc_name, text)]}.
    """
    import importlib.util

    spec = importlib.util.find_spec("licensedcode")
    if spec is None:
        raise RuntimeError("--source licensedcode needs `pip install licensedcode-data`")
    roots = list(spec.submodule_search_locations or [])
    files = sorted(f for r in roots for f in glob.glob(os.path.join(r, "data", "licenses", "*.LICENSE")))
    by_class = collections.defaultdict(list)
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.read()
        parts = raw.split("---\n", 2)
        if len(parts) < 3:
            continue
        header, text = parts[1], parts[2]
        fields = dict(line.split(":", 1) for line in header.splitlines() if ":" in line)
        if fields.get("is_deprecated", "").strip() in ("yes", "true"):
            continue
        category = fields.get("category", "").strip().strip("'\"").lower().replace(" ", "-")
        if category and text.strip():
            by_class[category].append((os.path.basename(path)[:-len(".LICENSE")], text))
    if not by_class:
        raise RuntimeError(f"no license files found under {roots}")
    return by_class


# Licence families by the words of a distribution's declared licence; the order matters where one
# name contains another (LGPL before GPL, both one family).
LICENSE_FAMILIES = (
    ("apache", r"\bapache\b"),
    ("bsd", r"\bbsd\b|0bsd"),
    ("mit", r"\bmit\b|\bexpat\b"),
    ("gpl", r"\b(a|l)?gpl|general public licen[cs]e"),
    ("mpl", r"\bmpl\b|mozilla"),
    ("psf", r"\bpsf|python software foundation"),
    ("isc", r"\bisc\b"),
    # Named so that a text under one of these and another family counts as dual-licensed.
    ("artistic", r"artistic"),
    ("zlib", r"\bzlib\b"),
    ("public-domain", r"public.domain"),
    ("cddl", r"\bcddl\b"),
    ("epl", r"\bepl\b|eclipse public"),
    ("afl", r"\bafl\b|academic free"),
)
LICENSE_FILE = re.compile(r"^(licen[cs]e|copying|notice)", re.IGNORECASE)


def license_family(declared):
    """The licence family that the declared licence names (strings) give, or None when they name none
    or several (a dual-licensed text would teach both labels)."""
    text = " ".join(declared).lower()
    found = {family for family, pattern in LICENSE_FAMILIES if re.search(pattern, text)}
    return found.pop() if len(found) == 1 else None


def python_declared_license(metadata):
    declared = [metadata.get("License-Expression") or ""]
    declared += [c for c in (metadata.get_all("Classifier") or []) if c.startswith("License ::")]
    field = metadata.get("License") or ""
    if len(field) <= 100:  # a long field is the licence text itself, not its name
        declared.append(field)
    return declared


def debian_declared_license(text):
    """The licence of the ``Files: *`` paragraph of a machine-readable Debian copyright file (None
    for a free-form file)."""
    for paragraph in re.split(r"\n\s*\n", text):
        if re.search(r"^Files:\s*\*\s*$", paragraph, re.M):
            match = re.search(r"^License:\s*(\S.*)$", paragraph, re.M)
            return match.group(1).strip() if match else None
    return None


def collect_licenses(doc_root="/usr/share/doc", python_paths=None):
    """{family: [(doc_name, text)]}: Debian's copyright files and the installed Python
    distributions' licence files, each labelled by the licence family it declares.

    The first of exact duplicates only (packages built from one source share a copyright file; the
    same text in train and test would measure memory, not classification).
    """
    by_class, seen_texts = collections.defaultdict(list), set()

    def add(family, name, text):
        digest = hashlib.sha256(" ".join(text.split()).encode()).hexdigest()
        if family is not None and text.strip() and digest not in seen_texts:
            seen_texts.add(digest)
            by_class[family].append((name, text))

    for path in sorted(glob.glob(os.path.join(doc_root, "*", "copyright"))):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        declared = debian_declared_license(text)
        if declared:
            add(license_family([declared]), "debian__" + os.path.basename(os.path.dirname(path)), text)
    for name, declared, text in python_licenses(python_paths):
        add(license_family(declared), "python__" + name, text)
    if not by_class:
        raise RuntimeError(f"no licence texts with a declared licence were found in {doc_root} or "
                           "the installed Python distributions")
    return by_class


def python_licenses(paths=None):
    """(name, declared licence strings, licence files' text) of each installed Python distribution
    that has licence files."""
    import importlib.metadata

    if paths is None:
        paths = list(sys.path) + [p for p in ("/usr/lib/python3/dist-packages",) if os.path.isdir(p)]
    seen_names = set()
    for dist in sorted(importlib.metadata.distributions(path=paths),
                       key=lambda d: (d.metadata.get("Name") or "").lower()):
        name = re.sub(r"[-_.]+", "-", (dist.metadata.get("Name") or "").lower())
        if not name or name in seen_names:
            continue
        seen_names.add(name)
        texts = []
        for f in sorted(dist.files or [], key=str):
            if not (f.parts[0].endswith((".dist-info", ".egg-info")) and LICENSE_FILE.match(f.parts[-1])):
                continue
            try:
                with open(f.locate(), encoding="utf-8", errors="replace") as fh:
                    texts.append(fh.read())
            except OSError:
                continue
        text = "\n\n".join(t for t in texts if t and t.strip())
        if text:
            yield name, python_declared_license(dist.metadata), text


def write_tree(by_class, out, min_docs, read=read_text):
    """Writes OUT/<class>/<doc>.txt for the classes with >= min_docs documents (OUT is replaced)."""
    if os.path.isdir(out):
        shutil.rmtree(out)
    kept = {c: docs for c, docs in sorted(by_class.items()) if len(docs) >= min_docs}
    dropped = {c: len(docs) for c, docs in sorted(by_class.items()) if len(docs) < min_docs}
    counts = {}
    for label, docs in kept.items():
        os.makedirs(os.path.join(out, label))
        n = 0
        for doc_name, source in docs:
            text = read(source)
            if not text.strip():
                continue
            with open(os.path.join(out, label, doc_name + ".txt"), "w", encoding="utf-8") as f:
                f.write(text)
            n += 1
        counts[label] = n
    return counts, dropped


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=["linux-doc", "licenses", "licensedcode"],
                   default="linux-doc")
    p.add_argument("--out", default=None, help="output folder-per-class tree, replaced if it "
                   "exists (default data/SOURCE)")
    p.add_argument("--package", default=DEFAULT_PACKAGE, help="Debian package with Documentation/")
    p.add_argument("--doc-root", default=None, help="a Documentation/ directory to read instead")
    p.add_argument("--min-docs", type=int, default=20, help="drop classes with fewer documents")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(REPO_ROOT, "data", args.source)
    if args.min_docs < 1:
        p.error(f"--min-docs must be >= 1. Received: min_docs={args.min_docs}")
    if args.doc_root is not None and not os.path.isdir(args.doc_root):
        p.error(f"--doc-root is not a directory. Received: doc_root={args.doc_root!r}")

    try:
        if args.source == "linux-doc":
            root = find_documentation(args.package, args.doc_root)
            print(f"reading {root}")
            by_class, merged = collect_linux_doc(root)
            print(f"merged into class 'arch': {' '.join(merged)}")
        elif args.source == "licenses":
            by_class = collect_licenses()
        else:
            by_class = collect_licensedcode()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:  # one line, not a traceback
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    counts, dropped = write_tree(by_class, args.out, args.min_docs,
                                 read=read_text if args.source == "linux-doc" else str)
    total = sum(counts.values())
    print(f"wrote {total} documents in {len(counts)} classes to {args.out}: "
          + ", ".join(f"{c} {n}" for c, n in counts.items()))
    if dropped:
        print(f"dropped classes with < {args.min_docs} documents: "
              + ", ".join(f"{c} ({n})" for c, n in dropped.items()))
    if len(counts) < 2:
        print(f"{p.prog}: error: fewer than 2 classes with >= {args.min_docs} documents: lower "
              f"--min-docs", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
