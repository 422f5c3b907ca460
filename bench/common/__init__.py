"""What the benchmark scripts share: timing (`timing`), result files written whole and resumed
(`results_io`), random-weight models (`models`) and the benchmark prompt sets (`prompts`)."""
