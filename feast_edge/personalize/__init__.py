"""Personalization on the device (after the federation): the served variant made right for the device's own data.

    prior:    the served model's logits + τ·log(the device's class prior) (no training, folded into the bias)
    finetune: head / bn / proximal fine-tuning on the device's training split
    select:   method and strength chosen on a selection split of the training split; the held-out split only measures
    fleet:    every device's own held-out counts, served vs personal, summed up as the mean and the worst decile

The personal model keeps the served variant's architecture (and so its MAC budget) and is exported beside it.
"""
