package l2
