"""Operations above the stages: the end-to-end demo and drift monitoring of served traffic."""
