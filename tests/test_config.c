/* Config files: presets load, every bad key or value is rejected by name,
 * writing and reading back gives the same config, and the K3 preset counts
 * the parameters the K3 report gives. */
#include "longmoe/config.h"
#include "test.h"

static lm_status parse(const char *text, lm_config *c) {
    lm_config_defaults(c);
    return lm_config_parse(text, strlen(text), "cfg.json", c);
}

static void test_presets_load_and_validate(void) {
    const char *presets[] = {"configs/tiny.json",     "configs/small.json",       "configs/k3-mini.json",
                             "configs/k3.json",       "configs/passkey-cpu.json", "configs/long-gpu.json",
                             "configs/text-gpu.json"};
    for (int i = 0; i < (int)(sizeof presets / sizeof presets[0]); i++) {
        lm_config c;
        CHECK(!lm_config_load(presets[i], &c), "%s: %s", presets[i], lm_last_error());
    }
}

static void test_k3_layout_and_counts_match_the_report(void) {
    lm_config c;
    CHECK(!lm_config_load("configs/k3.json", &c), "%s", lm_last_error());
    int mla = 0;
    for (int l = 0; l < c.n_layers; l++) mla += lm_config_mixer(&c, l) == LM_MIXER_MLA;
    CHECK(c.n_layers == 93 && mla == 24, "K3 has 69 KDA + 24 MLA layers, got %d MLA", mla);
    CHECK(lm_config_mixer(&c, 3) == LM_MIXER_MLA && lm_config_mixer(&c, 92) == LM_MIXER_MLA &&
          lm_config_mixer(&c, 0) == LM_MIXER_KDA, "layers 4 and 93 (1-based) are MLA");
    lm_plan p;
    lm_config_plan(&c, 8192, &p);
    /* the report: 2.8T total, 104B active; the config's unpublished details
     * (dense FFN width, shared expert width) leave a few percent of slack */
    CHECK(fabs(p.total_params / 2.8e12 - 1) < 0.03, "total %.4g", p.total_params);
    CHECK(fabs(p.total_active / 104e9 - 1) < 0.10, "active %.4g", p.total_active);
}

static void test_unknown_keys_and_bad_values_are_named(void) {
    struct { const char *text, *phrase; } cases[] = {
        {"{\"model\":{\"d_modle\":64}}", "unknown key 'model.d_modle'"},
        {"{\"modle\":{}}", "unknown section 'modle'"},
        {"{\"moe\":{\"top_k\":20}}", "moe.top_k must lie in [1, 16], got 20"},
        {"{\"moe\":{\"top_k\":2.5}}", "moe.top_k must be an integer"},
        {"{\"moe\":{\"top_k\":\"two\"}}", "moe.top_k must be a number"},
        {"{\"moe\":{\"balance\":\"magic\"}}", "moe.balance must be one of none|quantile|sign|aux"},
        {"{\"kda\":{\"g_min\":-6}}", "kda.g_min must lie in"},
        {"{\"kda\":{\"chunk\":48}}", "kda.chunk must be 16, 32 or 64"},
        {"{\"model\":{\"tie_embeddings\":1}}", "model.tie_embeddings must be true or false"},
        {"{\"model\":{\"n_layers\":3,\"layout\":\"kkmk\"}}", "model.layout has 4 letters"},
        {"{\"model\":{\"layout\":\"kkx\"}}", "'x' at layer 3"},
        {"{\"moe\":{\"routed_experts\":8,\"top_k\":8}}", "must be smaller than moe.routed_experts"},
        {"{\"attention\":{\"kind\":\"gqa\",\"heads\":6,\"kv_heads\":4}}", "multiple of attention.kv_heads"},
        {"{\"model\":{\"d_model\":64}", "invalid JSON"},
        {"[1]", "must be a JSON object"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64}]}}", "train.stages[0] needs seq_len and steps"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":5,\"batch_tokens\":100}]}}",
         "batch_tokens (100) must be a multiple of seq_len (64)"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":5,\"colour\":1}]}}", "unknown key 'train.stages[0].colour'"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":5,\"data\":{\"copy\":-1}}]}}",
         "the weight of 'copy' must be a number in (0, 1e30], got -1"},
        /* range-checked at parse time, as stored: beyond the float range (inf), and rounding to 0 */
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":5,\"data\":{\"copy\":1e39}}]}}",
         "train.stages[0].data: the weight of 'copy' must be a number in (0, 1e30], got 1e+39"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":5,\"data\":{\"copy\":1e-46}}]}}",
         "the weight of 'copy' must be a number in (0, 1e30]"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":5,\"data\":{\"copy\":\"x\"}}]}}",
         "the weight of 'copy' must be a number"},
        {"{\"train\":{\"stages\":[{\"seq_len\":64,\"steps\":10000000000000001}]}}",
         "train.stages[0].steps must be an integer in [1, 1e15]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_config c;
        lm_status s = parse(cases[i].text, &c);
        CHECK(s != LM_OK, "case %zu accepted: %s", i, cases[i].text);
        CHECK(strstr(lm_last_error(), cases[i].phrase) && strstr(lm_last_error(), "cfg.json"),
              "case %zu: '%s' lacks '%s'", i, lm_last_error(), cases[i].phrase);
    }
    lm_config c;
    CHECK(lm_config_load("configs/does-not-exist.json", &c) == LM_ERR_IO, "missing file");
}

static void test_written_config_reads_back_identically(void) {
    lm_config a, b;
    CHECK(!lm_config_load("configs/small.json", &a), "%s", lm_last_error());
    a.seed = 987654321987ull;
    a.kda_gate_softplus = 1;
    strcpy(a.layout, "kkmkkkkm");
    const char *staged = "{\"train\":{\"stages\":[{\"name\":\"short\",\"seq_len\":64,\"steps\":5,"
                         "\"data\":{\"copy\":2,\"mqar\":1}},{\"seq_len\":256,\"steps\":3,\"batch_tokens\":512,"
                         "\"lr_scale\":0.5}]}}";
    CHECK(!lm_config_parse(staged, strlen(staged), "staged.json", &a), "%s", lm_last_error());
    CHECK(a.n_stages == 2 && a.stages[0].n_data == 2 && a.stages[1].lr_scale == 0.5f &&
          lm_config_total_steps(&a) == 8, "stages parsed");
    char *json = lm_config_to_json(&a);
    CHECK(json != NULL, "to_json");
    if (!json) return;
    CHECK(!parse(json, &b), "%s\n%s", lm_last_error(), json);
    CHECK(!memcmp(&a, &b, sizeof a), "round trip differs");
    CHECK(lm_config_mixer(&b, 2) == LM_MIXER_MLA && lm_config_mixer(&b, 3) == LM_MIXER_KDA, "layout honoured");
    free(json);
}

int main(void) {
    RUN(test_presets_load_and_validate);
    RUN(test_k3_layout_and_counts_match_the_report);
    RUN(test_unknown_keys_and_bad_values_are_named);
    RUN(test_written_config_reads_back_identically);
    return test_summary();
}
