"""cuda_library: compiles .cu files with nvcc (one action per file) into a static library.

A small rule instead of a forked crosstool: nvcc runs with the C++ toolchain's compiler as host
compiler, sees only the headers of `hdrs` and of the cc_library targets in `deps` (so device code cannot
reach TensorFlow headers), and the archive is wrapped by a cc_library (see cuda_static_library) that
adds the CUDA runtime.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def gencode_flags(archs):
    """["80", "90a", "80+ptx"] -> nvcc -gencode flags."""
    flags = []
    for arch in archs:
        ptx = arch.endswith("+ptx")
        arch = arch.replace("+ptx", "")
        codes = "sm_" + arch
        if ptx:
            codes = "[sm_%s,compute_%s]" % (arch, arch)
        flags.append("-gencode=arch=compute_%s,code=%s" % (arch, codes))
    return flags

def _cuda_objects_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    host_compiler = cc_toolchain.compiler_executable
    if not host_compiler.startswith("/"):
        # A toolchain-relative wrapper: let nvcc use the gcc on PATH instead.
        host_compiler = None

    headers = [depset(ctx.files.hdrs)]
    include_flags = ["-I."]
    seen = {".": True}
    define_flags = []
    for dep in ctx.attr.deps:
        cc = dep[CcInfo].compilation_context
        headers.append(cc.headers)
        for flag, paths in [("-I", cc.quote_includes), ("-I", cc.includes), ("-isystem", cc.system_includes)]:
            for p in paths.to_list():
                if p not in seen:
                    seen[p] = True
                    include_flags += [flag, p]
        for d in cc.defines.to_list():
            define_flags.append("-D" + d)
    headers = depset(transitive = headers)

    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/%s/%s.o" % (ctx.label.name, src.basename.rsplit(".", 1)[0]))
        args = ctx.actions.args()
        if host_compiler:
            args.add("-ccbin", host_compiler)
        args.add_all(ctx.attr.copts)
        args.add_all(["-D" + d for d in ctx.attr.defines])
        args.add_all(define_flags)
        args.add_all(include_flags)
        args.add_all(["-x", "cu", "-c", src.path, "-o", obj.path])
        ctx.actions.run(
            executable = ctx.attr.nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [headers]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc %s" % src.short_path,
            use_default_shell_env = True,
        )
        objects.append(obj)

    archive = ctx.actions.declare_file("lib%s.a" % ctx.label.name)
    ar_args = ctx.actions.args()
    ar_args.add("rcsD", archive)
    ar_args.add_all(objects)
    ctx.actions.run(
        executable = cc_toolchain.ar_executable,
        arguments = [ar_args],
        inputs = depset(objects, transitive = [cc_toolchain.all_files]),
        outputs = [archive],
        mnemonic = "CudaArchive",
        progress_message = "archiving %s" % archive.short_path,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([archive]))]

cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh", ".hpp", ".inc"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "defines": attr.string_list(),
        "nvcc": attr.string(mandatory = True),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    doc = "Compiles .cu files with nvcc; outputs lib<name>.a.",
)

def cuda_static_library(name, srcs, hdrs = [], deps = [], copts = [], defines = [], nvcc = "", runtime = None, **kwargs):
    """A cc_library holding the nvcc-compiled objects of `srcs` plus `runtime` (the CUDA runtime)."""
    cuda_objects(
        name = name + "_nvcc",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps,
        copts = copts,
        defines = defines,
        nvcc = nvcc,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_nvcc"],
        deps = [runtime] if runtime else [],
        alwayslink = 1,
        linkstatic = 1,
        **kwargs
    )
