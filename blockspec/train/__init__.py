"""Training what blockspec decodes with: DFlash2 drafters for a target (`blockspec train-drafter`)."""
