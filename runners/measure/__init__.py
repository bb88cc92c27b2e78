"""Measurements of the whole stack: equality against eager (``equivalence``), the benchmark's
timing and memory probes (``benchmark``) and suite (``suite``), and the transformers baseline
(``hf_baseline``, which needs the test-only ``transformers``)."""
