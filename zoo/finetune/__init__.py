"""Finetuning task data (MNLI, QQP, SQuAD 1.1/2.0, RACE), input encoding and metrics."""
