"""mmoe: multiway Transformers with sparse Mixture-of-Experts FFNs."""
