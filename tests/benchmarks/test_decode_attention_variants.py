"""The decode attention variants study still applies to the kernel: every variant edits its source and imports."""

import tempfile

import pytest

from benchmarks.studies import decode_attention_variants as study


@pytest.mark.parametrize("name", sorted(study.VARIANTS))
def test_each_variant_edits_the_kernel_and_imports(name):
    module = study.variant_module(name, tempfile.mkdtemp())
    assert hasattr(module, "decode_attention_kernel") and hasattr(module, "decode_merge_kernel")
    source = open(module.__file__).read()
    kernel = study.variant_module("kernel", tempfile.mkdtemp())
    assert (source == open(kernel.__file__).read()) == (name == "kernel")


def test_a_revision_imports_whole_without_replacing_the_package_op():
    from tilekit.autotune.registry import registered_ops
    module = study.revision_module("HEAD", tempfile.mkdtemp())
    assert module.DECODE_ATTENTION is not study.da.DECODE_ATTENTION
    assert registered_ops()["decode_attention"] is study.da.DECODE_ATTENTION
