"""Mixture-of-experts layers: the router (router.py, routing.py), the MoE losses' way into the
gradient (aux_loss.py), the experts (experts.py) and the layer that joins them (layer.py)."""
