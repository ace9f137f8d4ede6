"""Offline `@rules_cc` and `@rules_java` for Debian's bazel-bootstrap (Bazel 4.2).

Bazel 4's own packages (`@bazel_tools//tools/cpp`, `@bazel_tools//tools/jdk`, whose
toolchains are registered for every build, and `@local_config_cc`) load
`@rules_cc//cc:defs.bzl` and `@rules_java//java:defs.bzl`, which Bazel's built-in
WORKSPACE suffix downloads from GitHub. Debian's `bazel-rules-cc` package is a newer
rules_cc that Bazel 4.2 cannot load. In Bazel 4 those macros only forward to the native
rules, so this repository rule writes the forwarding files locally and `bazel build //...`
needs no network access. (This build has no Java target; the JDK is only Bazel's own.)
"""

_CC_RULES = [
    "cc_binary",
    "cc_import",
    "cc_library",
    "cc_proto_library",
    "cc_test",
    "cc_toolchain",
    "cc_toolchain_suite",
    "fdo_prefetch_hints",
    "fdo_profile",
    "objc_import",
    "objc_library",
]

_JAVA_RULES = [
    "java_binary",
    "java_import",
    "java_library",
    "java_lite_proto_library",
    "java_package_configuration",
    "java_plugin",
    "java_proto_library",
    "java_runtime",
    "java_test",
    "java_toolchain",
]

def _forwarding_bzl(rules):
    return "".join([
        "def {r}(**attrs):\n    native.{r}(**attrs)\n\n".format(r = r)
        for r in rules
    ])

def _local_rules_impl(repository_ctx):
    name = repository_ctx.attr.language
    rules = {"cc": _CC_RULES, "java": _JAVA_RULES}[name]
    repository_ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % repository_ctx.name)
    repository_ctx.file("BUILD", "")
    repository_ctx.file(name + "/BUILD", "exports_files([\"defs.bzl\"])\n")
    repository_ctx.file(name + "/defs.bzl", _forwarding_bzl(rules))

local_rules = repository_rule(
    implementation = _local_rules_impl,
    attrs = {"language": attr.string(mandatory = True, values = ["cc", "java"])},
)
