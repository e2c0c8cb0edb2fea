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

``--source licensedcode`` is a pip-only alternative: the license texts of the ``licensedcode-data``
package (``pip install licensedcode-data``), labelled by license category.

Usage::

    python examples/long_document/prepare_data.py                  # -> data/linux-doc
    python examples/long_document/prepare_data.py --out /tmp/docs --min-docs 30
"""
import argparse
import collections
import glob
import gzip
import os
import shutil
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=["linux-doc", "licensedcode"], default="linux-doc")
    p.add_argument("--out", default=None, help="output folder-per-class tree, replaced if it "
                   "exists (default data/linux-doc or data/licensedcode)")
    p.add_argument("--package", default=DEFAULT_PACKAGE, help="Debian package with Documentation/")
    p.add_argument("--doc-root", default=None, help="a Documentation/ directory to read instead")
    p.add_argument("--min-docs", type=int, default=20, help="drop classes with fewer documents")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(REPO_ROOT, "data", args.source)
    if args.min_docs < 1:
        p.error(f"--min-docs must be >= 1. Received: min_docs={args.min_docs}")

    if args.source == "linux-doc":
        root = find_documentation(args.package, args.doc_root)
        print(f"reading {root}")
        by_class, merged = collect_linux_doc(root)
        print(f"merged into class 'arch': {' '.join(merged)}")
    else:
        by_class = collect_licensedcode()
    counts, dropped = write_tree(by_class, args.out, args.min_docs,
                                 read=read_text if args.source == "linux-doc" else str)
    total = sum(counts.values())
    print(f"wrote {total} documents in {len(counts)} classes to {args.out}")
    print(f"dropped classes with < {args.min_docs} documents: "
          + ", ".join(f"{c} ({n})" for c, n in dropped.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
