"""One module per study: its rows (name for --methods, label, the run's options;
the first row is the study's exact baseline) and how the study runs them."""
