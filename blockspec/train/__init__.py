"""Training what blockspec decodes with: a small target from scratch (`blockspec train-target`), DFlash2
drafters and MTP heads for a target (`blockspec train-drafter`)."""
