"""tf_flash_repositories(): every external repository of the build, all local (no downloads)."""

load("//bazel:cuda_configure.bzl", "cuda_configure")
load("//bazel:cutlass_configure.bzl", "cutlass_configure")
load("//bazel:tf_configure.bzl", "tf_configure")

def _needs_rule_stubs():
    # Bazel release binaries embed rules_cc/rules_java for offline use; bootstrapped builds (Debian's
    # bazel-bootstrap reports no version) and Bazel < 6 try to download them. Those get local stubs
    # that re-export the native rules; newer Bazels keep their own (their WORKSPACE suffix loads more
    # of rules_java than a stub should imitate).
    version = native.bazel_version
    if not version or not version[0].isdigit():
        return True
    major = version.split(".")[0]
    return major.isdigit() and int(major) < 6

def tf_flash_repositories():
    if _needs_rule_stubs():
        native.local_repository(name = "rules_cc", path = "bazel/stubs/rules_cc")
        native.local_repository(name = "rules_java", path = "bazel/stubs/rules_java")
    tf_configure(name = "local_tf")
    cutlass_configure(name = "local_cutlass")
    cuda_configure(name = "local_cuda")
