"""The benchmark harness: timing, system facts, output checks, rows and reports, markdown tables, plots."""
