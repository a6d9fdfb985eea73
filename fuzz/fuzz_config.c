/* libFuzzer harness of the config reader (lm_config_parse): any byte string
 * either gives an error or a config that passes validation, writes back to
 * JSON (lm_config_to_json, the config.json of every checkpoint) and reads back
 * to the identical struct, so a checkpoint's config can always be resumed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lm_config c, back;
    lm_config_defaults(&c);
    if (lm_config_parse((const char *)data, size, "fuzz input", &c) != LM_OK) return 0;
    if (lm_config_validate(&c) != LM_OK) abort();
    char *json = lm_config_to_json(&c);
    if (!json) abort();
    lm_config_defaults(&back);
    if (lm_config_parse(json, strlen(json), "round trip", &back) != LM_OK) {
        fprintf(stderr, "config did not read back: %s\n%s\n", lm_last_error(), json);
        abort();
    }
    if (memcmp(&c, &back, sizeof c) != 0) {
        fprintf(stderr, "config read back differently:\n%s\n", json);
        abort();
    }
    free(json);
    lm_plan p;
    lm_config_plan(&c, c.seq_len, &p);
    for (int l = 0; l < c.n_layers; l++) (void)lm_config_mixer(&c, l);
    return 0;
}
