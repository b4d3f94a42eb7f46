"""Statistics: matrix entropy, CKA, compartments, token filtering, a capture's analysis, layer-set selection, paired statistics."""
