"""Model building blocks, one module each: KDA, gated MLA, Block AttnRes, Stable LatentMoE, SiTU-GLU, norms."""
